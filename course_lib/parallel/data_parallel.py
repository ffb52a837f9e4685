"""Data parallelism from first principles, beside what `DistributedDataParallel` does (chapter 05).

Every rank holds the whole model and runs its own slice of the global batch; after backward,
every gradient is averaged over the ranks (an all-reduce), so every rank takes the same step:
the step a single process would take on the concatenated batch. Two hand-made versions, in the
spirit of picotron's `data_parallel.py`:

* `allreduce_gradients(model)`: after `loss.backward()`, one all-reduce per parameter. Correct,
  but communication starts only when the whole backward has finished.
* `DataParallelNaive(model)`: broadcasts rank 0's weights and buffers (every rank starts alike);
  then a hook on every parameter all-reduces its gradient the moment backward has accumulated it:
  communication starts early, but each all-reduce blocks backward until it is done (interleaved,
  not overlapped); `no_sync()` skips it on the micro-batches of gradient accumulation that are
  not the last.

`DistributedDataParallel` (`apply_ddp`) does the same, better: gradients are packed into ~25 MiB buckets (one
all-reduce per bucket, not per tensor), and each bucket is reduced asynchronously as soon as all
its gradients are ready. `CommLog` is a DDP communication hook that records what DDP sends, and
`timed_step` times one step with and without DDP's all-reduce (chapters 05 and 12).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ..timing import Clock, now


def apply_ddp(model: nn.Module, device: torch.device | None = None, **options) -> nn.Module:
    """`DistributedDataParallel` around `model`: the one way the course applies DDP (chapter 05's recipe, chapter
    12's, the SFT recipe's DDP backend). On a GPU its one device is named (`device_ids`), on the CPU none; `options`
    are DDP's own (`bucket_cap_mb`, `gradient_as_bucket_view`, ...), passed as they are. Wrapping broadcasts rank
    0's weights and buffers, so every rank starts alike."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device is not None and device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, **options)


def allreduce_gradients(model: nn.Module) -> None:
    """Average every gradient over the ranks, by hand, after backward (sum, then divide)."""
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world


class DataParallelNaive(nn.Module):
    """Wrap a model so that each parameter's gradient is averaged over the ranks as soon as it is ready.

    The hook fires after the gradient was *accumulated* into `p.grad`, so under `no_sync()` the
    local gradients of several micro-batches add up first and the last backward averages the sum.
    (A hook on the incoming gradient instead, `p.register_hook`, would reduce only the last
    micro-batch's share and leave the ranks out of step.)
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.require_backward_grad_sync = True
        self.world_size = dist.get_world_size()
        with torch.no_grad():  # every rank starts from rank 0's weights and buffers, as DDP's constructor does
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._average)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _average(self, p: torch.Tensor) -> None:
        if self.require_backward_grad_sync:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= self.world_size

    @contextmanager
    def no_sync(self):
        """Accumulate local gradients without communicating (all micro-batches but the last)."""
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = True


class CommLog:
    """A DDP communication hook that does what DDP does by default (average each bucket with an
    asynchronous all-reduce) and records each call: when it started (`t`) and finished (`done`), as marks
    of `clock` (a `cl.timing.Clock`: CUDA events on a GPU, where host clocks would time the launches), which
    bucket, how many elements.

        log = CommLog(); ddp.register_comm_hook(None, log.hook)
    """

    def __init__(self, clock: Clock | None = None):
        self.calls: list[dict] = []
        self.clock = clock or Clock()

    def hook(self, process_group, bucket):  # (no annotation: DDP checks it against the real class)
        buffer = bucket.buffer()
        call = {"t": self.clock.mark(), "index": bucket.index(), "numel": buffer.numel(),
                "storage": (buffer.untyped_storage().data_ptr(), buffer.untyped_storage().nbytes())}
        self.calls.append(call)

        def finished(fut):
            call["done"] = self.clock.mark()  # in the future's callback: after the all-reduce, on its stream
            return fut.value()

        return default_hooks.allreduce_hook(process_group, bucket).then(finished)

    def clear(self) -> None:
        self.calls.clear()


def gradient_bytes(model: nn.Module, log: CommLog) -> dict:
    """Bytes DDP holds for gradients after a backward: the `.grad` tensors and the flat buckets the hook saw,
    each storage counted once. With `gradient_as_bucket_view=True` the gradients *are* views of the
    buckets (one copy, 4Ψ in fp32); without it, two copies (8Ψ)."""
    grads = {(g.untyped_storage().data_ptr(), g.untyped_storage().nbytes()) for g in
             (p.grad for p in model.parameters()) if g is not None}
    buckets = {c["storage"] for c in log.calls}
    return {"grads": sum(n for _, n in grads), "buckets": sum(n for _, n in buckets),
            "total": sum(n for _, n in grads | buckets), "grads_are_buckets": grads <= buckets}


def timed_step(model, opt, batch: dict, sync: bool = True) -> float:
    """Seconds of one step of a DDP `model` on `batch` (`sync=False`: under no_sync(), no all-reduce at all)."""
    start = now()
    with nullcontext() if sync else model.no_sync():
        model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # DDP's buckets and the gradients stay allocated, as in training
    return now() - start
