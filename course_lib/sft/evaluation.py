"""Evaluation of a chat model on held-out conversations: the loss on their assistant tokens, greedy generation and
exact match.

For exact match, the model is asked each conversation up to its last assistant turn (system prompt and earlier turns
included), through the tokenizer's chat template, and its greedy answer is compared with that turn.
Introduced in chapter 09; used by chapters 10 and 12 and the SFT recipe.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from .data import collate, end_of_turn
from ..parallel.dist import all_reduce_scalar


def last_answer(messages: list[dict]) -> int:
    """The index of the conversation's last assistant turn: the answer evaluation asks for (a conversation may go
    on after it, e.g. a user's "thanks!": that is neither asked nor scored)."""
    return max(i for i, m in enumerate(messages) if m.get("role") == "assistant")


def prompt_of(messages: list[dict]) -> list[dict]:
    """The conversation up to its last assistant turn (system prompt and earlier turns included): what
    the model is asked, at evaluation, to answer."""
    return messages[:last_answer(messages)]


def reference_of(messages: list[dict]) -> str:
    """The answer a held-out conversation scores against: its last assistant turn's text (not its last message)."""
    return messages[last_answer(messages)]["content"]


@torch.no_grad()
def generate(model, tokenizer, prompts: list, max_new_tokens: int = 16, batch_size: int = 64, use_cache: bool = True,
             **kwargs) -> list[str]:
    """Greedy answers through the chat template (left padding, stop at the end-of-turn token). Each prompt
    is a conversation (a list of messages ending before the assistant's turn) or a user message string.
    `use_cache`: the KV cache, which training turns off in the model's config (`model_dir.load_weights`); without
    it each new token runs the whole sequence again (16 tokens at the 0.5B shape on one core: 12.0 s against 3.5 s,
    the same answers). `kwargs` go to `model.generate` (sharded models: `synced_gpus=True`, every rank steps
    together)."""
    end = tokenizer.convert_tokens_to_ids(end_of_turn(tokenizer) or tokenizer.eos_token)
    was_training, answers = model.training, []
    model.eval()
    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
    for i in range(0, len(prompts), batch_size):
        chats = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts[i:i + batch_size]]
        texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=end,
                             pad_token_id=tokenizer.pad_token_id, use_cache=use_cache, **kwargs)
        answers += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    return [a.strip() for a in answers]


MATCH_MARGIN = 3  # tokens generated past the longest answer turn: whitespace that strip() removes


def answer_turn(tokenizer, messages: list[dict]) -> tuple[int, str]:
    """What the chat template writes for the last assistant turn after the generation prompt: its length in tokens
    (the answer, its end of turn, and what the template adds: what a model that learned the turn generates), and the
    text the template puts before the answer's own (Qwen3's empty think block, `<think>\\n\\n</think>\\n\\n`; "" for
    ChatML): a model that learned the turn writes it first, and exact match compares what follows."""
    last = last_answer(messages)
    whole = tokenizer.apply_chat_template(messages[:last + 1], tokenize=False)
    asked = tokenizer.apply_chat_template(prompt_of(messages), tokenize=False, add_generation_prompt=True)
    n = len(tokenizer(whole, add_special_tokens=False)["input_ids"]) - len(tokenizer(asked, add_special_tokens=False)["input_ids"])
    tail, content = whole[len(asked):] if whole.startswith(asked) else "", messages[last]["content"]
    return n, tail[:tail.find(content)].strip() if content and content in tail else ""


def answer_after(answer: str, written_first: str) -> str:
    """The answer less what the template writes before every answer (`answer_turn`), where it starts with that."""
    return answer[len(written_first):].strip() if written_first and answer.startswith(written_first) else answer


def exact_match(model, tokenizer, rows: list[dict], max_new_tokens: int = 16, batch_size: int = 64,
                **kwargs) -> tuple[float, list]:
    """Share of held-out conversations whose greedy answer equals the reference (the last assistant turn)
    exactly; and the (question, reference, answer) triples. The model is asked the whole conversation
    before that turn, system prompt included; what the template writes before every answer (Qwen3's empty think
    block) is not part of the answer compared. Generation stops `MATCH_MARGIN` tokens past the longest answer turn
    as the template writes it (at most `max_new_tokens`): a longer answer cannot match, and each token is a forward
    (under FSDP2 or ZeRO-3 unless the model is gathered once for it, `backends.Single.generation`, a gather of every
    layer: 3.8 s a token at the 0.5B shape on 2 CPU ranks)."""
    prompts = [prompt_of(r["messages"]) for r in rows]
    refs = [reference_of(r["messages"]) for r in rows]
    turns = [answer_turn(tokenizer, r["messages"]) for r in rows]
    longest = max((n for n, _ in turns), default=0)
    answers = generate(model, tokenizer, prompts, min(max_new_tokens, longest + MATCH_MARGIN), batch_size, **kwargs)
    answers = [answer_after(a, first) for a, (_, first) in zip(answers, turns)]
    triples = [(p[-1]["content"] if p else "", r, a) for p, r, a in zip(prompts, refs, answers)]
    return sum(a == r for _, r, a in triples) / max(1, len(triples)), triples


def write_samples(path, step: int, samples: list) -> Path:
    """The (question, reference, answer) triples as JSONL, written whole (a crash leaves the old file)."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"step": step, "prompt": q, "reference": r, "answer": a}) + "\n"
                           for q, r, a in samples))
    tmp.replace(path)
    return path


def share_of(n: int, rank: int, world_size: int) -> range:
    """This rank's part of `n` held-out rows: contiguous, the first `n % world_size` ranks one row more, so every
    row is scored exactly once under any number of ranks."""
    size, extra = divmod(n, world_size)
    start = rank * size + min(rank, extra)
    return range(start, start + size + (rank < extra))


@torch.no_grad()
def held_out_loss(model, rows: list[dict], loss_fn, micro_batch: int, pad_id: int, ctx,
                  autocast=contextlib.nullcontext, padding_free: bool = False) -> float:
    """Mean `loss_fn(model, batch)` over the target tokens of tokenized held-out `rows`, all ranks together: each
    row scored exactly once, whatever the number of ranks (`share_of`). Every rank runs the same number of forwards
    (FSDP2 and ZeRO-3 take part in each other's all-gathers): a rank whose share is a micro-batch shorter runs one
    more on a row it does not count. The SFT recipe's held-out loss (chapter 10)."""
    if not rows:
        return float("nan")
    mine = [rows[i] for i in share_of(len(rows), ctx.rank, ctx.world_size)]
    forwards = -(-len(share_of(len(rows), 0, ctx.world_size)) // micro_batch)  # rank 0's share is the largest
    model.eval()
    total = count = 0.0
    for k in range(forwards):
        part = mine[k * micro_batch:(k + 1) * micro_batch]
        batch = {key: v.to(ctx.device) for key, v in collate(part or rows[:1], pad_id, padding_free).items()}
        with autocast():
            loss = float(loss_fn(model, batch))
        if part:
            n = int((batch["labels"][..., 1:] != -100).sum())
            total, count = total + loss * n, count + n
    model.train()
    return all_reduce_scalar(total) / max(1.0, all_reduce_scalar(count))
