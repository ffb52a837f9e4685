"""Losses that save memory: cross-entropy over a large vocabulary without the full logits.

`chunked_cross_entropy(hidden, lm_head_weight, labels)` equals
`F.cross_entropy(F.linear(hidden, lm_head_weight), labels, ignore_index=-100)`, gradients included, but
never holds the (tokens × vocabulary) logits. The plain version keeps three tensors of that size at its
peak (the saved log-probabilities, their gradient, the logits' gradient): with Qwen2.5's 151,936-word
vocabulary, the largest tensors of a training step. Here the LM head and the loss run `chunk` tokens at
a time, and each chunk's gradients (softmax − one-hot) are computed right away in the forward pass and
added in place into one gradient for the hidden states and one for the head's weight, which backward
only scales. Peak: one chunk's logits plus those two gradients, which training holds anyway. No matmul
is recomputed (the idea of Liger Kernel's fused linear cross-entropy, in plain PyTorch).
Chapter 03 derives it, first with activation checkpointing, and measures the saving.
"""
from __future__ import annotations

import torch

IGNORE_INDEX = -100


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum of the token losses; its gradients are made during forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, need_h, need_w):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None  # fp32 sums
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            trained = y != IGNORE_INDEX
            logits = (h @ weight.T).float()                     # (chunk, V): the only big tensor
            lse = logits.logsumexp(dim=-1)
            target = y.clamp(min=0).unsqueeze(1)
            total += ((lse - logits.gather(1, target).squeeze(1)) * trained).sum()
            if need_h or need_w:                                # d(sum of losses)/d(logits) = softmax - one-hot
                grad = logits.sub_(lse.unsqueeze(1)).exp_()
                grad.scatter_add_(1, target, -torch.ones_like(target, dtype=grad.dtype))
                grad.mul_(trained.unsqueeze(1))
                if need_h:
                    grad_h[start:start + chunk] = grad.to(weight.dtype) @ weight
                if need_w:
                    grad_w.addmm_(grad.T, h.float())
        ctx.grads, ctx.weight_dtype = (grad_h, grad_w), weight.dtype  # not saved tensors: backward hands them out
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.grads is None:
            raise RuntimeError("chunked_cross_entropy's backward ran twice: its gradients were already handed out")
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        grad_h = grad_h.mul_(grad_total.to(grad_h.dtype)) if grad_h is not None else None
        grad_w = grad_w.mul_(grad_total).to(ctx.weight_dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                          chunk: int = 1024, shift: bool = False, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of `F.linear(hidden, lm_head_weight)` against `labels`, `chunk` tokens at a time.

    hidden: (..., tokens, h), the final hidden states (after the model's last norm); lm_head_weight: (V, h);
    labels: (..., tokens), -100 where no loss is taken. shift=True predicts labels[..., 1:] from
    hidden[..., :-1], as `model(**batch).loss` does for a causal LM. reduction "mean" divides the sum by the
    number of labels that are not -100 (the result is 0 when there are none), "sum" returns the sum.
    Logits and softmax are computed in fp32. Backward may run once (no retain_graph).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk!r}")
    if shift:
        hidden, labels = hidden[..., :-1, :], labels[..., 1:]
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not match: "
                         "expected hidden (..., tokens, h) and labels (..., tokens)")
    if lm_head_weight.dim() != 2 or hidden.shape[-1] != lm_head_weight.shape[1]:
        raise ValueError(f"lm_head_weight {tuple(lm_head_weight.shape)} should be (vocabulary, {hidden.shape[-1]})")
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    grad_on = torch.is_grad_enabled()
    total = _ChunkedLinearCrossEntropy.apply(hidden, lm_head_weight, labels, chunk, grad_on and hidden.requires_grad,
                                             grad_on and lm_head_weight.requires_grad)
    if reduction == "sum":
        return total
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)
