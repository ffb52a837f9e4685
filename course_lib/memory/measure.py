"""Memory measurement: what training actually holds, to set beside `course_lib.memory`'s theory.

- `model_state_bytes(model, optimizer)`: parameters, gradients and optimizer state, tensor by tensor; for a
  sharded model (FSDP2's DTensors) what this rank holds: the local shards (`local`).
- `state_tensors(model, optimizer)`: the parameter, gradient and optimizer-state tensors a rank holds (plain,
  DDP, FSDP2, DeepSpeed engines), the baseline of `cl.LiveTensorBytes` (course_lib/memory/live_memory.py).
- `SavedTensors`: the exact bytes autograd keeps for backward (saved-tensor hooks; works on CPU), with a
  public `skip(t)` hook that says what not to count (parameters, by default).
- `cuda_peak_bytes()` / `peak_rss_bytes()`: the device's and the process's high-water marks;
  `reset_peak_rss()` starts the process's again; `RunPhases`: a run's high-water mark phase by phase.
Introduced in chapter 00; chapters 01, 03, 06, 07, 11 and 12 measure with them.
"""
from __future__ import annotations

import resource
import time
from collections import defaultdict
from contextlib import contextmanager

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's local shard (FSDP2, tensor parallelism), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (views of one storage count once; a DTensor counts
    its local shard: what this rank holds)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        storage = local(t).untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def flat_tensors(obj) -> list:
    """Every tensor in nested lists/dicts (DeepSpeed keeps its buffers that way)."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in flat_tensors(x)]
    return []


def gradient_tensors(engine) -> list:
    """The gradient storages a rank holds right now: `.grad` of the model's parameters plus the
    partitioned gradient buffers of ZeRO-1/2 (`averaged_gradients`, `grads_in_partition`, the
    offload tier's fp32 copy) and ZeRO-3 (`grad_partitions_flat_buffer`)."""
    opt = engine.optimizer
    found = [p.grad for p in engine.module.parameters() if p.grad is not None]
    for name in ("averaged_gradients", "grads_in_partition", "offload_gradient_dict", "grad_partitions_flat_buffer"):
        found += flat_tensors(getattr(opt, name, None))
    return [t for t in found if t.device.type != "meta"]


def plain_tensors(t: torch.Tensor):
    """The plain tensors that hold a tensor's data: itself, or a subclass's inner tensors
    (a DTensor's local shard, a quantized optimizer state's codes and scales)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(type(t), "__tensor_flatten__"):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            yield from plain_tensors(inner)


def state_tensors(model=None, optimizer=None) -> dict[str, list[torch.Tensor]]:
    """The parameters, gradients and optimizer-state tensors `model` and `optimizer` hold right now.

    `model`: a module (plain, DDP, FSDP2) or a DeepSpeed engine (its optimizer is used if none is given).
    Optimizer wrappers are followed through `.optimizer`: tensors a wrapper steps that are not the model's
    parameters are master copies and count as optimizer state, their `.grad` as gradients.
    """
    engine = model if hasattr(model, "zero_optimization_stage") else None
    if engine is not None:
        model, optimizer = engine.module, optimizer or engine.optimizer
    params = list(model.parameters()) if model is not None else []
    weights = params + [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None]
    chain, opt = [], optimizer
    while opt is not None and all(opt is not o for o in chain):
        chain.append(opt)
        opt = getattr(opt, "optimizer", None)
    own = {id(p) for p in params}
    master = [p for o in chain for g in getattr(o, "param_groups", []) for p in g["params"] if id(p) not in own]
    state = [v for o in chain for s in getattr(o, "state", {}).values() if isinstance(s, dict)
             for v in s.values() if torch.is_tensor(v)]
    if engine is not None and engine.zero_optimization_stage() == 3:
        # ZeRO-3 hands its fp32 partitions to the inner optimizer only inside step(): outside it they are found here
        master += [t for t in flat_tensors(engine.optimizer.fp32_partitioned_groups_flat)
                   if all(t is not m for m in master)]
    grads = [p.grad for p in params + master if p.grad is not None]
    if engine is not None:
        grads += gradient_tensors(engine)
    return {"parameters": weights, "gradients": grads, "optimizer": master + state}


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes this rank holds in parameters, gradients and optimizer state (after a step, so the state
    exists). Sharded (DTensor) parameters, gradients and states count their local shards.
    DeepSpeed keeps its own buffers: `cl.zero.held_bytes(engine)` walks those."""
    params = list(model.parameters())
    out = {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params),
        "optimizer": tensor_bytes(optimizer_state_tensors(optimizer)) if optimizer else 0,
    }
    out["total"] = sum(out.values())
    return out


class SavedTensors:
    """Count what autograd saves for backward inside a `with` block.

        with cl.SavedTensors(model) as saved:
            loss = model(**batch).loss
        saved.bytes, saved.by_dtype        # measured before backward frees them

    Parameters that autograd saves (a Linear keeps its weight) are not activations: `skip(t)` leaves
    them out when `model` is given. A DTensor counts its local shard, what this rank holds. Subclasses override
    `skip` to leave out more (chapter 11 looks the parameters up at save time, where FSDP2 and ZeRO-3 gather them).
    Storages shared by several saved tensors count once.
    """

    def __init__(self, model: torch.nn.Module | None = None):
        self._param_ptrs = {local(p).untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
        self._seen: set[int] = set()
        self.bytes = 0
        self.count = 0
        self.by_dtype: dict[str, int] = defaultdict(int)

    def skip(self, t: torch.Tensor) -> bool:
        """Whether a saved tensor is not an activation (here: it shares a parameter's storage)."""
        return t.untyped_storage().data_ptr() in self._param_ptrs

    def _pack(self, t: torch.Tensor):
        mine = local(t)  # a DTensor (tensor parallelism saves some): its local shard
        storage = mine.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._seen and not self.skip(mine):
            self._seen.add(ptr)
            self.bytes += storage.nbytes()
            self.count += 1
            self.by_dtype[str(t.dtype).replace("torch.", "")] += storage.nbytes()
        return t.detach()  # not `t`: an op's saved output would hold its own graph node, a cycle that outlives `del loss`

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self.by_dtype = dict(self.by_dtype)
        return False


def cuda_peak_bytes(reset: bool = False) -> int:
    """Peak bytes allocated on the current CUDA device (0 on CPU); `reset` starts a new window."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


@contextmanager
def cuda_peak():
    """`with cuda_peak() as p: ...` then `p["bytes"]`: peak CUDA bytes allocated inside the block."""
    result = {"bytes": 0}
    cuda_peak_bytes(reset=True)
    yield result
    result["bytes"] = cuda_peak_bytes()


def peak_rss_bytes(children: bool = False) -> int:
    """High-water resident memory of this process (or of its finished children), in bytes. On Linux this process's
    own mark, `VmHWM`: `getrusage`'s starts at the peak of the process that started this one (Linux keeps it across
    exec), so a rank or a subprocess started from a large kernel would report the kernel's peak as its own."""
    if not children:
        try:
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024  # kB
        except OSError:  # no /proc: getrusage below
            pass
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    return resource.getrusage(who).ru_maxrss * 1024  # Linux reports KiB


def reset_peak_rss() -> bool:
    """Start this process's high-water resident memory again from its present size (Linux 4.0 and later:
    `/proc/self/clear_refs`; `peak_rss_bytes` reads it). False where the system does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RunPhases:
    """A run's high-water resident memory and its seconds since `started` at the end of each phase (chapter 10's
    recipe: loaded, trained, exported, evaluated), and its `peak()`.

    `apart(name)` encloses a stretch whose memory belongs to an instrument, not to the run: the step that
    `cl.LiveTensorBytes` watches, where autograd sums the tied embedding's gradients out of place (0.55 GB
    more at the 0.5B shape). That stretch's own high-water mark is kept as phase `name`; then the mark starts
    again, and every later figure is the run's without it (with it, where the mark cannot be reset)."""

    def __init__(self, started: float):
        self.started, self.rss, self.seconds, self._outside = started, {}, {}, 0

    def peak(self) -> int:
        return max(self._outside, peak_rss_bytes())

    def done(self, name: str) -> None:
        self.rss[name], self.seconds[name] = self.peak(), time.perf_counter() - self.started

    @contextmanager
    def apart(self, name: str, when: bool = True):
        before = self.peak()
        yield
        if when:
            self.done(name)
            if reset_peak_rss():
                self._outside = before
