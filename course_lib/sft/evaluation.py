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


def prompt_of(messages: list[dict]) -> list[dict]:
    """The conversation up to its last assistant turn (system prompt and earlier turns included): what
    the model is asked, at evaluation, to answer."""
    last = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    return messages[:last]


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


def answer_turn_tokens(tokenizer, messages: list[dict]) -> int:
    """How many tokens the chat template writes for the last assistant turn after the generation prompt: the
    answer, its end of turn, and what the template adds (Qwen3's empty think block): what a model that learned
    the turn generates."""
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    asked = tokenizer.apply_chat_template(prompt_of(messages), tokenize=False, add_generation_prompt=True)
    return len(tokenizer(whole, add_special_tokens=False)["input_ids"]) - len(tokenizer(asked, add_special_tokens=False)["input_ids"])


def exact_match(model, tokenizer, rows: list[dict], max_new_tokens: int = 16, batch_size: int = 64,
                **kwargs) -> tuple[float, list]:
    """Share of held-out conversations whose greedy answer equals the reference (the last assistant turn)
    exactly; and the (question, reference, answer) triples. The model is asked the whole conversation
    before that turn, system prompt included. Generation stops `MATCH_MARGIN` tokens past the longest answer turn
    as the template writes it (at most `max_new_tokens`): a longer answer cannot match, and each token is a forward
    (under FSDP2 or ZeRO-3 unless the model is gathered once for it, `backends.Single.generation`, a gather of every
    layer: 3.8 s a token at the 0.5B shape on 2 CPU ranks)."""
    prompts = [prompt_of(r["messages"]) for r in rows]
    refs = [r["messages"][-1]["content"] for r in rows]
    longest = max((answer_turn_tokens(tokenizer, r["messages"]) for r in rows), default=0)
    answers = generate(model, tokenizer, prompts, min(max_new_tokens, longest + MATCH_MARGIN), batch_size, **kwargs)
    triples = [(p[-1]["content"], r, a) for p, r, a in zip(prompts, refs, answers)]
    return sum(a == r for _, r, a in triples) / max(1, len(triples)), triples


def write_samples(path, step: int, samples: list) -> Path:
    """The (question, reference, answer) triples as JSONL, written whole (a crash leaves the old file)."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"step": step, "prompt": q, "reference": r, "answer": a}) + "\n"
                           for q, r, a in samples))
    tmp.replace(path)
    return path


@torch.no_grad()
def held_out_loss(model, rows: list[dict], loss_fn, micro_batch: int, pad_id: int, ctx,
                  autocast=contextlib.nullcontext, padding_free: bool = False) -> float:
    """Mean `loss_fn(model, batch)` over the target tokens of tokenized held-out `rows`, all ranks together: each
    rank takes an equal share, so every rank runs the same number of forwards (FSDP2 and ZeRO-3 take part in each
    other's all-gathers). The SFT recipe's held-out loss (chapter 10)."""
    if not rows:
        return float("nan")
    share = len(rows) // ctx.world_size or len(rows)
    mine = rows[ctx.rank * share:(ctx.rank + 1) * share] if len(rows) >= ctx.world_size else rows
    model.eval()
    total = count = 0.0
    for i in range(0, len(mine), micro_batch):
        batch = {k: v.to(ctx.device) for k, v in collate(mine[i:i + micro_batch], pad_id, padding_free).items()}
        n = int((batch["labels"][..., 1:] != -100).sum())
        with autocast():
            total += float(loss_fn(model, batch)) * n
        count += n
    model.train()
    return all_reduce_scalar(total) / max(1.0, all_reduce_scalar(count))
