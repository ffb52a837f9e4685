"""Instruction data for supervised fine-tuning (SFT): synthetic tasks, JSONL, chat-template tokens, loss mask.

The format is the one SFT tools read: one JSON object per line, `{"messages": [{"role": "user", ...},
{"role": "assistant", ...}]}`, loaded with `datasets.load_dataset("json", ...)`. The tasks are small
enough for a tiny model to learn in minutes of CPU, with digit-level tokens (chapter 09 measures
it): "Reverse 5677693" -> "3967765". Tokenization goes through the tokenizer's chat template; the
labels keep only the assistant's tokens, in every turn, under any template (the prompt is masked with
-100), and `pack` can join examples into full rows. Tool-calling rows (a row-level `"tools"` list of function
schemas, assistant turns with `"tool_calls"`, `"tool"` results) render with their schema, and only what the
assistant says, its tool calls included, is trained. `course_lib.sft.evaluation` scores a model on held-out
conversations. Introduced in chapter 09; used by chapter 10 and `course_lib/recipes/sft.py`.
"""
from __future__ import annotations

import codecs
import functools
import json
import random
import re
import weakref
from pathlib import Path

import torch

IGNORE = -100  # the label value cross-entropy skips


# --- synthetic tasks -----------------------------------------------------------------------------
def _digits(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi)))


def _reverse(rng, lo, hi):
    s = _digits(rng, lo, hi)
    return f"Reverse {s}", s[::-1]


def _copy(rng, lo, hi):
    s = _digits(rng, lo, hi)
    return f"Copy {s}", s


def _sort(rng, lo, hi):
    s = _digits(rng, lo, hi)
    return f"Sort {s}", "".join(sorted(s))


def _add(rng, lo, hi):
    a, b = int(_digits(rng, lo, hi)), int(_digits(rng, lo, hi))
    return f"Add {a} and {b}", str(a + b)


TASKS = {"reverse": _reverse, "copy": _copy, "sort": _sort, "add": _add}


def make_examples(task: str = "reverse", n_train: int = 4000, n_eval: int = 200, seed: int = 0,
                  min_digits: int = 4, max_digits: int = 8) -> tuple[list[dict], list[dict]]:
    """(train, held_out) conversations of `task`; no held-out prompt occurs in the training set."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: choose one of {', '.join(TASKS)}")
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < n_train + n_eval:
        prompt, answer = TASKS[task](rng, min_digits, max_digits)
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
    return rows[n_eval:], rows[:n_eval]


def write_jsonl(rows: list[dict], path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if not path.is_file() or path.read_text() != text:  # unchanged files keep `datasets`' cache valid
        path.write_text(text)
    return path


def write_task(out_dir, task: str = "reverse", **kw) -> dict:
    """Write train.jsonl and eval.jsonl of `task` into `out_dir`; return their paths."""
    train, held_out = make_examples(task, **kw)
    out_dir = Path(out_dir)
    return {"train": str(write_jsonl(train, out_dir / "train.jsonl")),
            "eval": str(write_jsonl(held_out, out_dir / "eval.jsonl"))}


def load_jsonl(files: dict):
    """A `datasets.DatasetDict` from JSONL files ({"train": path, "eval": path}), as SFT tools load them."""
    from datasets import load_dataset

    return load_dataset("json", data_files=files)


ROLES = ("system", "user", "assistant", "tool")


DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def data_files(source) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of `--data-dir`: a data file itself (.jsonl, .json, .parquet); a directory with
    `train.<suffix>` (and `eval.<suffix>`); or a directory of data files, all of them training data. One line if none."""
    source = Path(source)
    if source.is_file():
        if source.suffix not in DATA_SUFFIXES:
            raise ChatFormatError(f"{source}: not a data file (read: {', '.join(DATA_SUFFIXES)})")
        return [source], []
    if not source.is_dir():
        raise ChatFormatError(f"{source}: no such file or directory (--data-dir takes a .jsonl, .json or .parquet file, "
                              f"or a directory of them: train.jsonl and eval.jsonl)")
    named = {stem: [source / (stem + x) for x in DATA_SUFFIXES if (source / (stem + x)).is_file()]
             for stem in ("train", "eval")}
    if named["train"]:
        return named["train"][:1], named["eval"][:1]
    found = sorted(f for f in source.iterdir() if f.is_file() and f.suffix in DATA_SUFFIXES)
    if not found or named["eval"]:
        raise ChatFormatError(f"{source}/train.jsonl: no such file (a data directory holds train.jsonl and eval.jsonl, "
                              f"or .json or .parquet files)")
    return found, []


HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # `name` or `owner/name`, as the hub spells them


def is_hub_name(source) -> bool:
    """Whether `--data-dir` names a dataset on the Hugging Face hub: no such local path, and spelt as a hub name
    (`owner/name` or `name`, no data file suffix)."""
    text = str(source)
    return not Path(text).exists() and bool(HUB_NAME.fullmatch(text)) and Path(text).suffix not in DATA_SUFFIXES


def read_hub(name: str) -> tuple[list[dict], tuple[str, list[dict]] | None]:
    """The conversations of hub dataset `name`, loaded with `datasets.load_dataset(name)` (from the hub, or from
    `datasets`' cache where it was downloaded before): its train split, and (split name, conversations) of its test or
    validation split where it has one (else None); every row in any format `as_messages` reads, checked. A dataset that
    will not load (no network, no such dataset) is one `ChatFormatError` line."""
    import logging

    quiet = [logging.getLogger(n) for n in ("huggingface_hub", "datasets")]  # their retries, one warning each
    levels = [q.level for q in quiet]
    try:
        from datasets import load_dataset

        for q in quiet:
            q.setLevel(logging.ERROR)
        splits = load_dataset(name)
    except Exception as e:  # offline: a ConnectionError or the hub client's own, many lines
        first = next(iter(str(e).strip().splitlines()), "")[:200]
        raise ChatFormatError(f"{name}: no such file or directory, and datasets.load_dataset({name!r}) failed "
                              f"({type(e).__name__}{': ' + first if first else ''}); give a local path, or load it "
                              f"once where there is a network (datasets caches it)") from None
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    if "train" not in splits:
        raise ChatFormatError(f"{name}: the dataset has no train split (its splits: {', '.join(splits) or 'none'})")

    def rows(split: str) -> list[dict]:
        out = [check_row(_no_nulls(r), f"{name}[{split}] row {i}") for i, r in enumerate(splits[split], 1)]
        if not out:
            raise ChatFormatError(f"{name}[{split}]: no conversations")
        return out

    held = next((s for s in ("test", "validation") if s in splits), None)
    return rows("train"), (held, rows(held)) if held else None


def read_data(path) -> list[dict]:
    """The conversations of a data file, by its suffix: JSONL (`read_chats`), a JSON array of rows, or parquet (read
    with pyarrow, which `datasets` is built on); every row in any format `as_messages` reads, checked by `check_row`
    (an error names the file and the row)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return read_chats(path)
    if not path.is_file():
        raise ChatFormatError(f"{path}: no such file")
    if path.suffix == ".json":
        data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
        if data.lstrip()[:1] == b"{":
            return read_chats(path)  # JSON lines in a .json file (as `datasets`' json loader reads them too)
        try:
            rows = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ChatFormatError(f"{path}: not a JSON array of rows ({e})") from None
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = [_no_nulls(r) for r in pq.read_table(path).to_pylist()]
    else:
        raise ChatFormatError(f"{path}: not a data file (read: {', '.join(DATA_SUFFIXES)})")
    if not isinstance(rows, list):
        raise ChatFormatError(f"{path}: expected a JSON array of rows, got {_short(rows)}")
    out = [check_row(r, f"{path}: row {i}") for i, r in enumerate(rows, 1)]
    if not out:
        raise ChatFormatError(f"{path}: no conversations")
    return out


def _no_nulls(row):
    """A parquet row without the null fields its column types add (a message gets every key any message has)."""
    if isinstance(row, dict):
        return {k: _no_nulls(v) for k, v in row.items() if v is not None or k == "content"}
    return [_no_nulls(v) for v in row] if isinstance(row, list) else row


def read_chats(path) -> list[dict]:
    """The conversations of a chat JSONL file (`{"messages": [{"role": ..., "content": ...}, ...]}` per line, or any
    format `as_messages` reads, with an optional `"tools": [...]` list of function schemas, as `apply_chat_template(..., tools=...)` takes
    them), checked: a byte that is not UTF-8, a malformed row, an unknown role, malformed tools or tool calls
    or a conversation with no assistant turn stops with one `ChatFormatError` line naming the file and line.
    Lines end at "\\n" only (JSON strings may hold U+2028 and other Unicode line breaks, which `str.splitlines`
    would cut at); a UTF-8 byte order mark at the start is skipped; blank lines are skipped."""
    path, rows = Path(path), []
    if not path.is_file():
        raise ChatFormatError(f"{path}: no such file (a data directory holds train.jsonl and eval.jsonl)")
    lines = path.read_bytes().removeprefix(codecs.BOM_UTF8).split(b"\n")
    for number, raw in enumerate(lines, 1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ChatFormatError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the "
                                  f"line); save the file as UTF-8") from None
        if not line.strip():
            continue
        rows.append(check_chat(line, where))
    if not rows:
        raise ChatFormatError(f"{path}: no conversations")
    return rows


def check_chat(line: str, where: str) -> dict:
    """One JSONL line as a conversation (`check_row`), or one `ChatFormatError` naming `where`."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ChatFormatError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    return check_row(row, where)


# ShareGPT's speakers (`from`) as chat roles; LLaMA-Factory's `observation` is a tool's result
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "observation": "tool", "tool": "tool"}
FORMATS = ('"messages" (OpenAI: role/content), "conversations" (ShareGPT: from/value) or "prompt" and "completion" '
           '(strings, or lists of messages)')


def as_messages(row, where: str) -> dict:
    """A row of any format the recipe reads, as `{"messages": [...]}` (its `"tools"` kept): the one place formats are
    converted. ShareGPT (`{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}], "system": ...}`):
    each turn's `from` becomes its role, `value` its content, a row-level `system` the first message.
    prompt/completion (TRL's): strings become a user and an assistant turn; lists of messages are joined. Anything
    else: one `ChatFormatError` naming the keys the row has."""
    if not isinstance(row, dict):
        raise ChatFormatError(f"{where}: expected a JSON object with {FORMATS}, got {_short(row)}")
    extra = {"tools": row["tools"]} if row.get("tools") is not None else {}
    if "messages" in row:
        return row
    if isinstance(row.get("conversations"), list):
        messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
        for turn in row["conversations"]:
            speaker = turn.get("from") if isinstance(turn, dict) else None
            if speaker not in SHAREGPT_ROLES:
                raise ChatFormatError(f"{where}: ShareGPT turn from {speaker!r}: expected one of "
                                      f"{', '.join(SHAREGPT_ROLES)}, got {_short(turn)}")
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn.get("value")})
        return {"messages": messages, **extra}
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
                    **extra}
        if isinstance(prompt, list) and isinstance(completion, list):
            return {"messages": prompt + completion, **extra}
        raise ChatFormatError(f"{where}: \"prompt\" and \"completion\" must both be strings or both lists of "
                              f"messages, got {_short(prompt)} and {_short(completion)}")
    raise ChatFormatError(f"{where}: not a conversation: expected {FORMATS}; the row has keys "
                          f"{', '.join(map(repr, row)) or 'none'}")


def check_row(row, where: str) -> dict:
    """One row (any format `as_messages` reads) as a conversation `{"messages": [...]}` (and `"tools": [...]` when the
    row has some), or one `ChatFormatError` naming `where`. An assistant message may have `"content": null` (or none)
    when it has `"tool_calls"` (OpenAI's format): it becomes "", which chat templates render (Qwen3's fails on null)."""
    row = as_messages(row, where)
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError(f"{where}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}}")
    checked = []
    for m in messages:
        if not isinstance(m, dict):
            raise ChatFormatError(f"{where}: every message needs a role and a text content, got {_short(m)}")
        if m.get("role") not in ROLES:
            raise ChatFormatError(f"{where}: unknown role {m.get('role')!r} (roles: {', '.join(ROLES)})")
        if m["role"] == "assistant" and m.get("tool_calls") is not None:  # null: no call (OpenAI's exports)
            _check_tool_calls(m["tool_calls"], where)
        if m["role"] == "assistant" and m.get("content") is None:
            if not m.get("tool_calls"):
                raise ChatFormatError(f"{where}: an assistant message has neither content nor tool_calls: {_short(m)}")
            m = {**m, "content": ""}
        if not isinstance(m.get("content"), str):
            raise ChatFormatError(f"{where}: every message needs a role and a text content, got {_short(m)}")
        checked.append(m)
    if not any(m["role"] == "assistant" for m in checked):
        raise ChatFormatError(f"{where}: the conversation has no assistant turn: nothing to train on")
    tools = row.get("tools")
    if tools is not None:
        _check_tools(tools, where)
    return {"messages": checked, "tools": tools} if tools else {"messages": checked}


TOOL_SHAPE = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'


def _short(value) -> str:
    """A value in an error line: its repr (newlines escaped: the error stays one line), cut at 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _function(entry) -> dict | None:
    """The function of a tool schema or tool call: `entry["function"]` (OpenAI's and Hugging Face's shape) or the
    entry itself (the flat shape templates also read), if it is a dict with a string name."""
    fn = entry.get("function", entry) if isinstance(entry, dict) else None
    return fn if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"] else None


def _check_tools(tools, where: str) -> None:
    if isinstance(tools, str):
        raise ChatFormatError(f"{where}: \"tools\" is a string: it must be a JSON list of function schemas "
                              f"({TOOL_SHAPE}), not a string holding one")
    if not isinstance(tools, list) or not all(_function(t) for t in tools):
        bad = tools if not isinstance(tools, list) else next(t for t in tools if not _function(t))
        raise ChatFormatError(f"{where}: \"tools\" must be a list of function schemas ({TOOL_SHAPE}), "
                              f"got {_short(bad)}")


def _check_tool_calls(calls, where: str) -> None:
    """An assistant's `tool_calls`: a list of `{"type": "function", "function": {"name": ..., "arguments": ...}}`,
    arguments a JSON object or a string holding one (OpenAI writes a string; templates render either)."""
    if not isinstance(calls, list):
        raise ChatFormatError(f"{where}: \"tool_calls\" must be a list of calls, got {_short(calls)}")
    for call in calls:
        fn = _function(call)
        args = fn.get("arguments") if fn else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            raise ChatFormatError(f"{where}: every tool call needs a function name and arguments (a JSON object or a "
                                  f"string holding one), got {_short(call)}")


def empty_answers(rows: list[dict]) -> int:
    """How many assistant turns say nothing (empty content, no tool call): only their end-of-turn token is
    trained, which teaches the model to answer with nothing."""
    return sum(1 for r in rows for m in r["messages"]
               if m["role"] == "assistant" and not (m.get("content") or "").strip() and not m.get("tool_calls"))


# --- tokenization with the chat template ---------------------------------------------------------
# A `{% generation %}` block in the template (the tag, not the word: Qwen's templates say
# `add_generation_prompt`, which is not one).
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatFormatError(ValueError):
    """A conversation the chat template cannot turn into training tokens (one line: what and why)."""


def has_generation_block(tokenizer) -> bool:
    return bool(GENERATION_TAG.search(tokenizer.chat_template or ""))


def assistant_mask(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, mask) of one conversation: mask 1 on every token the assistant says, in every turn, its tool
    calls included; `tools` (the row's function schemas) are rendered by the template, in the prompt, not trained.

    With a template that marks the assistant's turns with `{% generation %}` (the course's), the
    tokenizer returns the mask itself. Any other template (Qwen2.5's and Qwen3's as shipped, Llama's...)
    goes through `template_mask`: `prefix_mask`'s tokens (found by rendering the conversation's prefixes), at the
    cost of one rendering.
    A template that drops the row's tools or an assistant's tool calls (the course's ChatML renders neither)
    stops with a `ChatFormatError`: it would train tool calls without their schema, or empty turns.
    """
    if not any(m.get("role") == "assistant" for m in messages):
        raise ChatFormatError("the conversation has no assistant turn: nothing to train on")
    messages, tools = renderable(messages), tools or None
    if has_generation_block(tokenizer):
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        ids, mask = template_mask(tokenizer, messages, tools)
    if tools or any(m.get("tool_calls") for m in messages):
        _check_tools_rendered(tokenizer, messages, tools, ids, mask)
    return ids, mask


def renderable(messages: list[dict]) -> list[dict]:
    """The messages as chat templates take them: an assistant's `"content": null` beside its tool calls becomes ""
    (Qwen3's template fails on null; every template renders "")."""
    return [{**m, "content": ""} if m.get("content") is None and m.get("role") == "assistant" else m for m in messages]


def _check_tools_rendered(tokenizer, messages, tools, ids, mask) -> None:
    """The template renders the row's tools (its text changes with them) and each tool call's function name inside
    the trained tokens."""
    if tools and tokenizer.apply_chat_template(messages, tools=tools, tokenize=False) == \
            tokenizer.apply_chat_template(messages, tokenize=False):
        raise ChatFormatError("the chat template ignores the row's \"tools\": the model would learn to call tools "
                              "without their schema (use a template that renders tools, as Qwen's does)")
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    calls = [call for m in messages if m.get("role") == "assistant" for call in m.get("tool_calls") or []]
    for call in calls:
        name = (_function(call) or {}).get("name")
        if name and name not in trained:
            raise ChatFormatError(f"the chat template does not render the assistant's tool call {name!r} into its "
                                  f"turn: the turn would train without it (use a template that renders "
                                  f"tool_calls, as Qwen's does)")


def end_of_turn(tokenizer) -> str | None:
    """The special token the template closes an assistant turn with (`<|im_end|>` for ChatML), read off a
    rendered probe: the first token after the assistant's text, if it is an added (special) token."""
    probe = "\x00probe\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}],
                                         tokenize=False)
    tail = text.split(probe, 1)[1]
    added = tokenizer.get_added_vocab()
    first = next((t for t in sorted(added, key=len, reverse=True) if tail.startswith(t)), None)
    return first


def generation_header(tokenizer) -> str:
    """What the template writes to open an assistant turn (`<|im_start|>assistant\\n` for ChatML): the text
    `add_generation_prompt=True` adds to a rendered probe conversation ("" if it adds nothing readable)."""
    probe = [{"role": "user", "content": "\x00probe\x00"}]
    bare = tokenizer.apply_chat_template(probe, tokenize=False)
    asked = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    return asked[len(bare):] if asked.startswith(bare) else ""


def prefix_mask(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """The mask of any chat template, by prefixes: for each assistant turn i, the conversation before it,
    rendered with `add_generation_prompt=True`, is a prefix of the whole rendering; the assistant's
    tokens run from there to the end-of-turn token included (ChatML's trailing newline is not trained:
    the model stops at `<|im_end|>`). Character spans become token spans through the tokenizer's offsets,
    so the ids are exactly `apply_chat_template(messages, tools=tools, tokenize=True)`'s. Every rendering gets
    the row's `tools`, so the prefixes are the whole's (the tools section comes first).

    Two cases the rule needs help with. A conversation that opens with the assistant has no prefix to
    render, yet the template may write something first (Qwen2.5's default system prompt): the turn starts
    after the first assistant header. An end-of-turn token written literally inside the content (a chat
    about chat templates) is not the end: the turn ends at the end-of-turn token after all of those."""
    messages = renderable(messages)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    eot = end_of_turn(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = _turn_start(tokenizer, messages, i, text, tools)
        if eot and eot in text[start:]:
            stop = start
            for _ in range(_said(message).count(eot) + 1):  # the literal ones inside what it says, then its own
                stop = text.find(eot, stop) + len(eot)
        else:
            stop = _next_prefix(tokenizer, messages, i, tools)
        spans.append((start, stop))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    return ids, mask


def _said(message: dict) -> str:
    """Everything of an assistant message a template writes verbatim: content, reasoning, tool call names and
    arguments (where a literal end-of-turn token may hide)."""
    parts = [message.get("content") or "", message.get("reasoning_content") or ""]
    for call in message.get("tool_calls") or []:
        fn = _function(call) or {}
        args = fn.get("arguments")
        parts += [str(fn.get("name", "")), args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)]
    return "\n".join(parts)


def _turn_start(tokenizer, messages, i, text, tools=None) -> int:
    """Where assistant turn i's own text starts in the whole rendering `text`."""
    if i == 0:  # nothing before it to render: skip what the template writes first, up to the assistant's header
        header = generation_header(tokenizer)
        return text.find(header) + len(header) if header and header in text else 0
    prompt = tokenizer.apply_chat_template(messages[:i], tools=tools, tokenize=False, add_generation_prompt=True)
    if not text.startswith(prompt):
        raise ChatFormatError(f"the chat template does not render the conversation before assistant turn {i} "
                              f"as a prefix of the whole: its mask cannot be found (add a {{% generation %}} block)")
    return len(prompt)


def _next_prefix(tokenizer, messages, i, tools=None) -> int:
    """Without an end-of-turn token: the turn ends where the conversation up to it ends."""
    return len(tokenizer.apply_chat_template(messages[:i + 1], tools=tools, tokenize=False))


def template_mask(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """`prefix_mask`'s (ids, mask), exactly, at the cost of one rendering of the conversation at any number of turns
    (`prefix_mask` renders a prefix per assistant turn: quadratic in the turns).

    The prefixes' lengths depend on the conversation's shape (its roles, tool calls, tools, which contents are
    empty), not on what the messages say, as long as the template writes each content as it is: they are found once
    per shape, by `prefix_mask`'s own rule, on a skeleton of the conversation whose contents are short placeholders
    (cached per tokenizer), and moved to the real conversation by the placeholders' lengths. Checked on every
    conversation: the skeleton's rendering with the contents put back must be the real rendering, character for
    character. Where a check fails, or a content holds one of the tokenizer's special tokens (a template may branch on
    those: Qwen3's on `</think>` and `<tool_response>`; a literal end-of-turn token), `prefix_mask` itself answers."""
    messages = renderable(messages)
    known = _template_state(tokenizer)
    contents = [m.get("content") for m in messages]
    if not all(isinstance(c, str) for c in contents) or any(known["marked"].search(c) for c in contents):
        return prefix_mask(tokenizer, messages, tools)
    skeleton = [{**m, "content": f"\x00{j}\x00" if m["content"] else ""} for j, m in enumerate(messages)]
    key = json.dumps([skeleton, tools], sort_keys=True, default=str)
    if key not in known["shapes"]:
        if len(known["shapes"]) > 4096:  # (a bound on the memory the shapes hold)
            known["shapes"].clear()
        try:
            known["shapes"][key] = _skeleton_spans(tokenizer, skeleton, tools, known["eot"])
        except Exception:  # the prefix rule fails on the skeleton (or the template raises): the real one answers
            known["shapes"][key] = None
    shape = known["shapes"][key]
    if shape is None:
        return prefix_mask(tokenizer, messages, tools)
    pieces, turns = shape
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    starts, put_back, at = [], [], 0  # each piece's start in the real text, and the real text rebuilt
    for k, piece in enumerate(pieces):
        if k % 2:  # a placeholder: the content it stands for
            piece = contents[int(piece)]
        else:
            starts.append(at)
        put_back.append(piece)
        at += len(piece)
    if "".join(put_back) != text:
        return prefix_mask(tokenizer, messages, tools)
    eot, spans = known["eot"], []
    for i, (piece, offset, stop_piece, stop_offset) in turns.items():
        if i == 0:  # (as `_turn_start`: after the first assistant header)
            header = known.setdefault("header", generation_header(tokenizer))
            start = text.find(header) + len(header) if header and header in text else 0
        else:
            start = starts[piece // 2] + offset
        if eot and eot in text[start:]:
            stop = start
            for _ in range(_said(messages[i]).count(eot) + 1):
                stop = text.find(eot, stop) + len(eot)
        elif stop_piece is not None:
            stop = starts[stop_piece // 2] + stop_offset
        else:  # (the skeleton's turn ended at an end-of-turn token, the real one does not)
            return prefix_mask(tokenizer, messages, tools)
        spans.append((start, stop))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), _in_spans([s for s, _ in enc["offset_mapping"]], spans)


def _template_state(tokenizer) -> dict:
    """What `template_mask` keeps per tokenizer and template: the end-of-turn token, a pattern of the special tokens
    (and of the placeholders' NUL), and the shapes seen so far."""
    state = _TEMPLATES.get(tokenizer)
    if state is None or state["template"] != tokenizer.chat_template:
        specials = sorted(tokenizer.get_added_vocab(), key=len, reverse=True) + ["\x00"]
        state = {"template": tokenizer.chat_template, "eot": end_of_turn(tokenizer), "shapes": {},
                 "marked": re.compile("|".join(map(re.escape, specials)))}
        _TEMPLATES[tokenizer] = state
    return state


_TEMPLATES = weakref.WeakKeyDictionary()


def _skeleton_spans(tokenizer, skeleton, tools, eot) -> tuple[list[str], dict]:
    """The skeleton's rendering cut at its placeholders (even pieces: template text; odd: a placeholder's message
    index), and for each assistant turn where `prefix_mask`'s rule puts its start (and its stop, where no end-of-turn
    token follows) as (piece, offset in it): a position in the template's own text, which the real conversation
    shares. Raises where the rule does (a template whose prefixes are not prefixes of the whole)."""
    text = tokenizer.apply_chat_template(skeleton, tools=tools, tokenize=False)
    pieces = re.split(r"\x00(\d+)\x00", text)
    bounds, at = [], 0
    for k, piece in enumerate(pieces):
        if k % 2 == 0:
            bounds.append((at, at + len(piece)))
        at += len(piece) + 2 if k % 2 else len(piece)  # a placeholder: NUL, its digits, NUL

    def where(position: int) -> tuple[int, int]:  # the template text holding `position` (never a placeholder)
        for k, (a, b) in enumerate(bounds):
            if a <= position <= b:
                return 2 * k, position - a
        raise ChatFormatError("a turn boundary inside a content")

    turns = {}
    for i, message in enumerate(skeleton):
        if message.get("role") != "assistant":
            continue
        start = _turn_start(tokenizer, skeleton, i, text, tools)
        piece, offset = where(start) if i else (0, 0)
        stop = (None, None) if eot and eot in text[start:] else where(_next_prefix(tokenizer, skeleton, i, tools))
        turns[i] = (piece, offset, *stop)
    return pieces, turns


def _in_spans(starts: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose first character lies in one of `spans` ([start, stop) character ranges), else 0: one pass
    over tokens and spans in order (`any(a <= s < b ...)` per token, as `prefix_mask` writes it, where they are out
    of order)."""
    if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
        return [int(any(a <= s < b for a, b in spans)) for s in starts]
    out, k = [], 0
    for s in starts:
        while k < len(spans) and spans[k][1] <= s:
            k += 1
        out.append(int(k < len(spans) and spans[k][0] <= s))
    return out


def tokenize_example(example: dict, tokenizer, max_len: int | None = None) -> dict:
    """input_ids and labels (-100 except on the assistant's tokens), truncated to `max_len`; the row's `tools`, if
    any, are rendered into the prompt."""
    ids, mask = assistant_mask(tokenizer, example["messages"], example.get("tools"))
    labels = [t if m else IGNORE for t, m in zip(ids, mask)]
    return {"input_ids": ids[:max_len], "labels": labels[:max_len]}


def tokenize_chats(rows: list[dict], tokenizer, max_len: int) -> tuple[list[dict], dict]:
    """Tokenized examples truncated to `max_len`, and what truncation did: `examples`, `truncated`, `dropped`
    (no assistant token left within `max_len`: they would train on nothing), `target_tokens` kept and
    `target_tokens_cut`, and `empty_answers` (`empty_answers`). A dataset with no target token left at all stops
    with one `ChatFormatError`."""
    out, stats = [], {"examples": len(rows), "truncated": 0, "dropped": 0, "target_tokens": 0, "target_tokens_cut": 0,
                      "empty_answers": empty_answers(rows)}
    longest_prompt = 0
    for row in rows:
        full = tokenize_example(row, tokenizer)
        kept = {k: v[:max_len] for k, v in full.items()}
        targets = sum(t != IGNORE for t in kept["labels"][1:])
        stats["target_tokens_cut"] += sum(t != IGNORE for t in full["labels"][1:]) - targets
        stats["truncated"] += len(full["input_ids"]) > max_len
        if targets == 0:
            stats["dropped"] += 1
            longest_prompt = max(longest_prompt, next(i for i, t in enumerate(full["labels"]) if t != IGNORE))
            continue
        stats["target_tokens"] += targets
        out.append(kept)
    if not out:
        raise ChatFormatError(f"no example has an assistant token within --seq-len {max_len}: every prompt is longer "
                              f"(the longest has {longest_prompt} tokens); raise --seq-len")
    return out, stats


def describe_truncation(stats: dict, max_len: int) -> str:
    """One line on what `tokenize_chats` did, a warning first when it dropped examples."""
    line = (f"{stats['examples']:,} examples: {stats['truncated']:,} truncated to --seq-len {max_len}, "
            f"{stats['target_tokens']:,} target tokens kept ({stats['target_tokens_cut']:,} cut)")
    if stats["dropped"]:
        line = (f"warning: {stats['dropped']:,} of {stats['examples']:,} examples dropped: no assistant token within "
                f"--seq-len {max_len} (their prompts are longer; raise --seq-len to keep them). " + line)
    return line


def tokenize_dataset(ds, tokenizer, max_len: int):
    return ds.map(lambda ex: tokenize_example(ex, tokenizer, max_len), remove_columns=ds.column_names)


def pack(ds, seq_len: int):
    """Join tokenized examples into rows of exactly `seq_len` tokens (greedy, no example split).

    `position_ids` restart at 0 for every example: transformers then keeps attention inside each
    example (a block-diagonal causal mask), so packing removes the padding without mixing examples.
    """
    from datasets import Dataset

    rows, cur = [], {"input_ids": [], "labels": [], "position_ids": []}

    def flush():
        pad = seq_len - len(cur["input_ids"])
        # the padding continues as one more "example" whose labels are ignored
        rows.append({"input_ids": cur["input_ids"] + [0] * pad, "labels": cur["labels"] + [IGNORE] * pad,
                     "position_ids": cur["position_ids"] + list(range(pad))})

    for ids, labels in zip(ds["input_ids"], ds["labels"]):
        if cur["input_ids"] and len(cur["input_ids"]) + len(ids) > seq_len:
            flush()
            cur = {"input_ids": [], "labels": [], "position_ids": []}
        cur["input_ids"] += ids
        cur["labels"] += labels
        cur["position_ids"] += list(range(len(ids)))
    if cur["input_ids"]:
        flush()
    return Dataset.from_list(rows)


def collate(rows: list[dict], pad_id: int, padding_free: bool = False) -> dict:
    """A right-padded training batch: padding gets attention_mask 0 and label -100. `padding_free=True`: the
    rows joined into one row of their total length, no padding (`flatten`)."""
    if "position_ids" in rows[0]:  # packed rows: all the same length, no attention mask needed
        return {k: torch.tensor([r[k] for r in rows]) for k in ("input_ids", "labels", "position_ids")}
    if padding_free:
        return flatten(rows)
    width = max(len(r["input_ids"]) for r in rows)
    batch = {"input_ids": [], "labels": [], "attention_mask": []}
    for r in rows:
        pad = width - len(r["input_ids"])
        batch["input_ids"].append(list(r["input_ids"]) + [pad_id] * pad)
        batch["labels"].append(list(r["labels"]) + [IGNORE] * pad)
        batch["attention_mask"].append([1] * len(r["input_ids"]) + [0] * pad)
    return {k: torch.tensor(v) for k, v in batch.items()}


def flatten(rows: list[dict]) -> dict:
    """The rows as ONE row of their total length, without padding (what `transformers`'
    `DataCollatorWithFlattening` makes): `position_ids` restart at 0 for each example, so attention stays
    inside it, and each example's first label is -100, so no example is scored on predicting the next one's
    first token. The same examples, targets and loss as `collate` (tests/test_speed.py), no padding computed."""
    batch = {"input_ids": [], "labels": [], "position_ids": []}
    for r in rows:
        batch["input_ids"] += r["input_ids"]
        batch["labels"] += [IGNORE, *r["labels"][1:]]
        batch["position_ids"] += range(len(r["input_ids"]))
    return {k: torch.tensor([v]) for k, v in batch.items()}


# --- the workspace of chapters 09-10 -------------------------------------------------------------
def chat_corpus(rows: list[dict]) -> list[str]:
    """Texts to train a tokenizer on: the conversations' roles and contents, as the template lays them out."""
    return [f"user\n{r['messages'][0]['content']}\nassistant\n{r['messages'][-1]['content']}\n" for r in rows]


def sft_workspace(root, model_path=None, model: dict | None = None, task: str = "reverse", n_train: int = 4000,
                  n_eval: int = 200, seed: int = 0, vocab_size: int = 512) -> tuple:
    """(model_dir, data_dir): the task's train/eval JSONL under `root/data-<task>`, and `model_path` checked
    (a real Qwen2.5), or a tiny Qwen2 of shape `model` with a tokenizer trained on the tasks under `root/base`."""
    from . import model_dir

    root = Path(root)
    data_dir = root / f"data-{task}"
    write_task(data_dir, task, n_train=n_train, n_eval=n_eval, seed=seed)
    if model_path:
        return model_dir.check_model_dir(model_path), data_dir
    texts = chat_corpus(make_examples("reverse", 1000, 0, seed)[0] + make_examples("copy", 1000, 0, seed + 1)[0])
    return model_dir.make_tiny_checkpoint(root / "base", texts, model or {}, vocab_size=vocab_size, seed=seed), data_dir


# --- the data order: a function of the step only (exact resume in the SFT recipe) ---------------------
@functools.lru_cache(maxsize=2)
def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def step_indices(step: int, n: int, global_batch: int, seed: int) -> list[int]:
    """Indices of the global batch of `step`: consecutive slices of a stream of per-epoch permutations."""
    start, out = step * global_batch, []
    while len(out) < global_batch:
        epoch, offset = divmod(start + len(out), n)
        out += epoch_order(n, seed, epoch)[offset:offset + global_batch - len(out)]
    return out


# --- tokenized data on disk: built once, read by every rank and every later run of the same inputs ------------------
TOKENS_FORMAT = 1  # the cache file's layout; a new one makes every older cache a miss


def tokens_key(conversations, tokenizer, max_len: int, masking: str = "every assistant turn") -> str:
    """What tokenized data depends on, as one hash: the conversations themselves (the data files' content, after the
    held-out split), the tokenizer (its files' bytes where it was loaded from a directory, else its vocabulary), its
    chat template, `max_len`, the masking rule, this module's source (the code that renders and masks) and the
    tokenizer library's version. A change of any of them is another key: the cache is built again."""
    import hashlib

    import tokenizers
    import transformers

    from .tokenizer import TEMPLATE_FILES, TOKENIZER_FILES

    h = hashlib.sha256(f"format {TOKENS_FORMAT} len {max_len} mask {masking} transformers {transformers.__version__} "
                       f"tokenizers {tokenizers.__version__}\n".encode())
    h.update(Path(__file__).read_bytes())
    h.update(json.dumps(conversations, sort_keys=True, ensure_ascii=False).encode())
    h.update((tokenizer.chat_template or "").encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    source = Path(getattr(tokenizer, "name_or_path", "") or "")
    files = [source / f for f in (*TOKENIZER_FILES, *TEMPLATE_FILES)] if source.is_dir() else []
    if any(f.is_file() for f in files):
        for f in files:
            h.update(f.name.encode() + (f.read_bytes() if f.is_file() else b"-"))
    else:  # a tokenizer made in memory: its vocabulary
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return h.hexdigest()[:24]


def save_tokens(path, parts: dict) -> bool:
    """`parts` ({name: (rows, stats)}, rows as `tokenize_chats` makes them) written whole or not at all: flat int32 ids
    and labels with each row's length (a .tmp, then a rename: a reader never sees half a file). False, and nothing
    written, where the place is not writable or full."""
    import os

    path = Path(path)
    out = {}
    for name, (rows, stats) in parts.items():
        out[name] = {"input_ids": torch.tensor([t for r in rows for t in r["input_ids"]], dtype=torch.int32),
                     "labels": torch.tensor([t for r in rows for t in r["labels"]], dtype=torch.int32),
                     "lengths": torch.tensor([len(r["input_ids"]) for r in rows], dtype=torch.int64),
                     "stats": dict(stats)}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(out, tmp)
        os.replace(tmp, path)
        return True
    except (OSError, RuntimeError):  # (torch's zip writer reports a full disk as a RuntimeError)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False


def load_tokens(path) -> dict | None:
    """What `save_tokens` wrote, as {name: (rows, stats)}; None where there is no such file or it does not read."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, weights_only=True)
        parts = {}
        for name, part in saved.items():
            ids, labels = part["input_ids"].tolist(), part["labels"].tolist()
            rows, start = [], 0
            for n in part["lengths"].tolist():
                rows.append({"input_ids": ids[start:start + n], "labels": labels[start:start + n]})
                start += n
            parts[name] = (rows, part["stats"])
        return parts
    except Exception:  # a damaged or foreign file: tokenize again
        return None
