"""Training-loop pieces: accumulation, warmup + cosine schedule, gradient norm, a run monitor.

Chapter 04 builds each of these in the open and checks it; later chapters (SFT, the capstone) reuse them:

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sched = cl.train.warmup_cosine(opt, warmup_steps=20, total_steps=200, min_lr_ratio=0.1)
    monitor = cl.train.Monitor("09_sft")                      # TensorBoard events + an inline history
    for step in range(200):
        micro = cl.train.split_batch(next(batches), accum_steps)
        stats = cl.train.train_step(model, opt, micro, scheduler=sched, max_grad_norm=1.0)
        monitor.log(step, **stats)                            # loss, grad_norm, lr (loss_scale with a scaler)
    monitor.plot(); monitor.close()

Causal-LM batches are dicts with `input_ids` and `labels` (label -100 = ignored), as `cl.models.random_batch`
and the SFT data make them; the model returns the mean loss over its target tokens (`model(**batch).loss`).
"""
from __future__ import annotations

import math
import sys
import types
from collections import defaultdict

import torch


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """The multiplier of the base learning rate at `step` (chapter 04):
    0 → 1 linearly over `warmup_steps`, then a cosine from 1 down to `min_lr_ratio` at `total_steps`,
    flat at `min_lr_ratio` after. The cosine ends ON the floor (it is scaled into [floor, 1]), not
    clipped at it as the seed's `max(decayed, min_lr)` does."""
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"need 0 <= warmup_steps <= total_steps, got {warmup_steps} and {total_steps}")
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio must lie in [0, 1], got {min_lr_ratio}")
    if step < warmup_steps:
        return step / warmup_steps
    if step >= total_steps:
        return min_lr_ratio
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                  min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` following `lr_factor` (chapter 04). Call `scheduler.step()` once per optimizer step;
    the learning rate of step t (counting from 0) is then `base_lr * lr_factor(t, ...)`."""
    lr_factor(0, warmup_steps, total_steps, min_lr_ratio)  # validate the arguments now, not at step 0
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, min_lr_ratio))


def global_grad_norm(parameters, norm_type: float = 2.0) -> float:
    """The norm of all gradients taken as one vector (what `clip_grad_norm_` measures and returns);
    not the mean of per-tensor norms. Parameters without a gradient are skipped. Chapter 04."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type))


def split_batch(batch: dict, k: int) -> list[dict]:
    """Cut a batch (dict of tensors, batch first) into `k` micro-batches of equal size. Chapter 04."""
    n = next(iter(batch.values())).shape[0]
    if k < 1 or n % k:
        raise ValueError(f"cannot split a batch of {n} into {k} equal micro-batches")
    return [{key: v[i * n // k:(i + 1) * n // k] for key, v in batch.items()} for i in range(k)]


def count_targets(batch: dict) -> int:
    """Tokens a causal LM is scored on: labels after the one-token shift that are not -100."""
    return int((batch["labels"][..., 1:] != -100).sum())


def accumulate(model: torch.nn.Module, micro_batches: list[dict], weight: str = "tokens", scaler=None) -> float:
    """Forward + backward over every micro-batch, adding into `.grad`; returns the full batch's mean loss.

    Each micro-batch loss (a mean over its own target tokens) is scaled before backward so that the summed
    gradients equal the full batch's (chapter 04): `weight="tokens"` scales by its share of target tokens
    (exact with padding or masked prompts), `weight="mean"` by 1/k (exact only when every micro-batch has
    the same number of targets). With a `torch.amp.GradScaler`, the scaled loss is what goes backward."""
    if weight not in ("tokens", "mean"):
        raise ValueError(f"weight must be 'tokens' or 'mean', got {weight!r}")
    counts = [count_targets(mb) for mb in micro_batches] if weight == "tokens" else [1] * len(micro_batches)
    total, loss_sum = sum(counts), 0.0
    for mb, n in zip(micro_batches, counts):
        loss = model(**mb).loss * (n / total)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += float(loss.detach())
    return loss_sum


def train_step(model, optimizer, micro_batches: list[dict], scheduler=None, max_grad_norm: float | None = None,
               scaler=None, weight: str = "tokens") -> dict:
    """One optimizer step over accumulated micro-batches (chapter 04): accumulate, unscale (with a
    scaler), clip to `max_grad_norm` (None: measure only), step, zero the gradients, advance the schedule.
    Returns the step's `loss`, `grad_norm` (before clipping), `lr` (the one this step used) and
    `loss_scale` when a scaler is given: the scalars a `Monitor` logs."""
    loss = accumulate(model, micro_batches, weight=weight, scaler=scaler)
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if max_grad_norm is not None:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    else:
        grad_norm = global_grad_norm(params)
    stats = {"loss": loss, "grad_norm": grad_norm, "lr": optimizer.param_groups[0]["lr"]}
    if scaler is not None:
        stats["loss_scale"] = float(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return stats


def _summary_writer(log_dir: str, purge_step: int | None = None):
    # torch.utils.tensorboard imports TensorFlow (≈ 10 s) when it is installed, only for a few helpers it can
    # take from tensorboard's own stub: point tensorboard at the stub unless the kernel already has TF.
    if "tensorflow" not in sys.modules:
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir, purge_step=purge_step)


class Monitor:
    """Logs a run's scalars to TensorBoard event files and keeps them for inline plots (chapter 04).

        monitor = cl.train.Monitor("04_accumulation")   # events in build/tensorboard/04_accumulation
        monitor.log(step, loss=..., grad_norm=..., lr=...)
        monitor.history["loss"]                          # [(step, value), ...]
        monitor.plot()                                   # one panel per scalar; returns the figure

    `tensorboard --logdir build/tensorboard` shows every run. `log_dir` overrides the place; the event
    files of an earlier run under the same name are removed unless `overwrite=False`. A run resumed from a
    checkpoint of step N appends (`overwrite=False`) with `purge_step=N + 1`: what the interrupted run logged from
    that step on, which the resumed run logs again, TensorBoard leaves out (a `SessionLog.START` at that step)."""

    def __init__(self, name: str, log_dir: str | None = None, overwrite: bool = True, purge_step: int | None = None):
        from pathlib import Path

        from ..paths import build_dir

        self.log_dir = str(log_dir or build_dir() / "tensorboard" / name)
        self.name = name
        if overwrite:
            for old in Path(self.log_dir).glob("events.out.tfevents.*"):
                old.unlink()
        self.writer = _summary_writer(self.log_dir, purge_step)
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def log(self, step: int, **scalars) -> None:
        for key, value in scalars.items():
            if value is None:
                continue
            value = float(value)
            self.writer.add_scalar(key, value, step)
            self.history[key].append((step, value))

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and values of one scalar."""
        if key not in self.history:
            raise KeyError(f"nothing logged under {key!r}; logged: {', '.join(self.history) or 'nothing'}")
        steps, values = zip(*self.history[key])
        return list(steps), list(values)

    def plot(self, keys=None, log_scale=("grad_norm", "loss_scale"), ncols: int = 4):
        """One small panel per scalar (all of them, or `keys`); returns the matplotlib figure."""
        import matplotlib.pyplot as plt

        keys = list(keys or self.history)
        ncols = min(ncols, len(keys))
        nrows = math.ceil(len(keys) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.4 * nrows), squeeze=False)
        for ax, key in zip(axes.flat, keys):
            ax.plot(*self.series(key), lw=1.2)
            ax.set_title(key, fontsize=10)
            ax.set_xlabel("step", fontsize=8)
            if key in log_scale:
                ax.set_yscale("log")
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        fig.suptitle(self.name, fontsize=10)
        fig.tight_layout()
        return fig

    def close(self) -> None:
        self.writer.close()
