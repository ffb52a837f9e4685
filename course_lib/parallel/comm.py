"""Communication: what each collective moves, counted where the frameworks call the process group, and
what it costs on this machine.

* `CommCounter`: a dispatch mode (chapter 03 counts memory the same way) that sees every collective this
  rank starts, whoever starts it: DDP's C++ reducer, DeepSpeed, FSDP2, DTensor, `torch.distributed.pipelining`.
  Each call is recorded with its kind, its payload (the bytes of the whole tensor the collective is about:
  the all-reduced tensor, the all-gathered output, the reduce-scattered input, the sent tensor), the
  group's size, a tag (a phase or a layer), and when it started and finished.
* `ring_factor`: the bytes one rank sends per payload byte under the bandwidth-optimal (ring) algorithms:
  all-reduce 2(N−1)/N · S, all-gather and reduce-scatter (N−1)/N · S, a send S. The ledgers'
  `comm_bytes_<strategy>` are these sums, per rank per optimizer step.
* the cost model: `sweep` times each collective over a range of message sizes; `fit_alpha_beta` fits
  t = α + β · S (α: latency per call, 1/β: bandwidth); `predict_seconds` adds α + β · S over a step's calls.
  The fit summarizes bare calls on this machine; what transfers to other hardware is the bytes and the number of
  calls (chapter 05).

Introduced in chapter 05; chapters 06, 07 and 08 count with it (recipes ddp, zero, fsdp, tp, pp).
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .. import timing
from .dist import collective_device

FITTED = ("all_reduce", "all_gather", "reduce_scatter")  # the collectives the cost model is fitted for

# c10d op -> (kind, which argument holds the payload: the all-gathered output, the reduce-scattered input, ...)
_C10D = {"allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0), "allgather_": ("all_gather", 0),
         "_allgather_base_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
         "reduce_scatter_": ("reduce_scatter", 1), "_reduce_scatter_base_": ("reduce_scatter", 1),
         "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1), "broadcast_": ("broadcast", 0),
         "reduce_": ("reduce", 0), "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0),
         "alltoall_base_": ("all_to_all", 1), "gather_": ("gather", 0), "scatter_": ("scatter", 0)}
# functional collectives (DTensor, torch.compile): kind; their payload is the input (× N for all-gather)
_FUNCTIONAL = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
               "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
               "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
               "reduce_scatter_tensor_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all",
               "broadcast": "broadcast", "broadcast_": "broadcast"}


def ring_factor(kind: str, n: int) -> float:
    """Bytes one rank sends per payload byte, for the bandwidth-optimal algorithm on n ranks: all-reduce
    2(N−1)/N, a send 1, a receive 0, the others (all-gather, reduce-scatter, broadcast, reduce, ...) (N−1)/N."""
    if n <= 1 or kind == "recv":
        return 0.0
    return 2 * (n - 1) / n if kind == "all_reduce" else 1.0 if kind == "send" else (n - 1) / n


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _dtype(x) -> str:
    while isinstance(x, (list, tuple)) and x:
        x = x[0]
    return str(x.dtype).replace("torch.", "") if isinstance(x, torch.Tensor) else ""


@dataclass
class Call:
    kind: str
    payload: int  # bytes of the whole tensor the collective is about
    ranks: int  # the group's size
    dtype: str
    tag: str
    start: float  # time.perf_counter() when it was started ...
    end: float | None = None  # ... and when it finished (None: not known)

    @property
    def wire(self) -> float:
        return ring_factor(self.kind, self.ranks) * self.payload


class CommCounter(TorchDispatchMode):
    """Record every collective this rank starts inside the `with` block:

        with cl.comm.CommCounter() as comm:
            loss = ddp(**batch).loss; loss.backward()
        comm.summary()        # {"all_reduce": {"calls": 3, "payload": 4_194_304, "wire": 4_194_304.0}, ...}
        comm.total()          # bytes this rank sent (ring algorithms), all kinds

    `timed=True` lines the ranks up before each collective (a barrier, not timed), then waits for it and
    records how long it took: the calls run one after the other, started together, no overlap with compute,
    which is what the α + β model predicts. Without it, a finish time is still recorded where the process group's work reports one.
    Set `counter.tag` (or use `tagged` / `tag_modules`) to attribute calls to a phase or a layer.
    """

    def __init__(self, timed: bool = False):
        from torch.distributed.tensor import DTensor

        super().__init__()
        self.timed, self.tag, self.calls, self._dtensor = timed, "", [], DTensor
        self.barrier_s = 0.0  # timed: seconds in the barriers that line the ranks up (not in any call's time)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented  # a DTensor: let it run and turn into plain collectives, which we then see
        namespace = func.namespace
        if namespace not in ("c10d", "_c10d_functional"):
            return func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        call, group = self._describe(namespace, name, args)
        if call is not None and self.timed and call.kind not in ("send", "recv"):
            lined_up = time.perf_counter()
            dist.barrier(group=group)  # every rank starts it together (as in the sweep): its own duration, no skew
            call.start = time.perf_counter()
            self.barrier_s += call.start - lined_up
        out = func(*args, **kwargs)
        if call is None:
            return out
        self.calls.append(call)
        if namespace == "_c10d_functional":
            if self.timed:
                torch.ops._c10d_functional.wait_tensor(out if isinstance(out, torch.Tensor) else out[0])
                call.end = time.perf_counter()
            return out
        work = out[1] if isinstance(out, tuple) else out
        try:
            work = dist.Work.unbox(work)
            if self.timed:
                work.wait()
                call.end = time.perf_counter()
            else:
                work.get_future().then(lambda _f, c=call: setattr(c, "end", time.perf_counter()))
        except (RuntimeError, AttributeError):  # a work without a future (some send/recv): no finish time
            pass
        return out

    def _describe(self, namespace: str, name: str, args) -> tuple[Call | None, object]:
        """The call (None: not a collective we count) and its process group."""
        start = time.perf_counter()
        if namespace == "c10d":
            if name not in _C10D:
                return None, None
            kind, which = _C10D[name]
            group = dist.ProcessGroup.unbox(next(a for a in args if isinstance(a, torch.ScriptObject)))
            data = args[which]
            return Call(kind, _nbytes(data), group.size(), _dtype(data), self.tag, start), group
        if name not in _FUNCTIONAL:
            return None, None
        kind, group = _FUNCTIONAL[name], dist.distributed_c10d._resolve_process_group(args[-1])  # by its name
        payload = _nbytes(args[0]) * (group.size() if kind == "all_gather" else 1)
        return Call(kind, payload, group.size(), _dtype(args[0]), self.tag, start), group

    @contextmanager
    def tagged(self, tag: str):
        """Attribute the calls inside the block to `tag`."""
        before, self.tag = self.tag, tag
        try:
            yield self
        finally:
            self.tag = before

    def select(self, kind: str | None = None, tag: str | None = None) -> list[Call]:
        return [c for c in self.calls if (kind is None or c.kind == kind) and (tag is None or c.tag == tag)]

    def total(self, kind: str | None = None, tag: str | None = None, wire: bool = True) -> float:
        """Bytes this rank sent (wire=True, ring algorithms) or the payloads' sum, of the selected calls."""
        return sum(c.wire if wire else c.payload for c in self.select(kind, tag))

    def summary(self, tag: str | None = None) -> dict:
        """Per kind: number of calls, payload bytes, bytes sent by this rank, and seconds (of the calls that
        report a finish)."""
        out = {}
        for c in self.select(tag=tag):
            s = out.setdefault(c.kind, {"calls": 0, "payload": 0, "wire": 0.0, "seconds": 0.0})
            s["calls"] += 1
            s["payload"] += c.payload
            s["wire"] += c.wire
            s["seconds"] += 0.0 if c.end is None else c.end - c.start
        return out

    def seconds(self, kind: str | None = None, tag: str | None = None) -> float:
        """Summed durations of the selected calls that report one (with `timed=True`: all of them)."""
        return sum(c.end - c.start for c in self.select(kind, tag) if c.end is not None)

    def records(self, t0: float = 0.0) -> list[dict]:
        """The calls as plain dicts (for `cl.dist.report`), times relative to `t0`."""
        return [{**asdict(c), "start": c.start - t0, "end": None if c.end is None else c.end - t0, "wire": c.wire}
                for c in self.calls]


def traffic(counter: CommCounter, fits: dict | None = None) -> dict:
    """A counter's figures as one plain dict: per kind, per tag, bytes sent, seconds measured and predicted."""
    tags = dict.fromkeys(c.tag for c in counter.calls)
    return {"summary": counter.summary(), "by_tag": {t: counter.summary(t) for t in tags}, "bytes": counter.total(),
            "calls": len(counter.calls), "seconds": counter.seconds(),
            "predicted_s": predict_seconds(counter.calls, fits or {})}


def time_forward(model, batch: dict, layers: dict, repeat: int) -> dict:
    """Seconds of `repeat` forwards (each followed by an untimed backward) and the last one's timeline: each
    layer's compute [name, start, end] and each collective's start and finish, not waited for (they overlap as
    they do). Hooks added after `fully_shard` run after FSDP2's own: a layer's span starts once its gather landed.
    On a GPU the layers' moments are CUDA events (`timing.Clock`: when the GPU got there, not when the host queued
    the work) and the forward's seconds wait for the GPU (`timing.now`)."""
    clock = timing.Clock(next(model.parameters()).device)
    spans, seconds, handles = [], [], []
    for name, m in layers.items():
        handles += [m.register_forward_pre_hook(lambda m, a, n=name: spans.append([n, clock.mark()])),
                    m.register_forward_hook(lambda m, a, o: spans[-1].append(clock.mark()))]
    for _ in range(repeat):
        spans.clear()
        dist.barrier()
        with CommCounter() as comm:
            origin, start = clock.mark(), timing.now()  # the same moment: now() waits until the GPU is there
            loss = model(**batch).loss
            seconds.append(timing.now() - start)
        loss.backward()
    for h in handles:
        h.remove()
    return {"forward_s": seconds, "layers": [(n, clock.seconds(origin, a), clock.seconds(origin, b)) for n, a, b in spans],
            "calls": comm.records(start)}


def tag_modules(counter: CommCounter, modules: dict) -> list:
    """Tag the calls made while each module runs: `"<name> fwd"` in its forward, `"<name> bwd"` in its
    backward (chapter 08: communication per layer). The hooks run before any other (a parallel style's input
    redistribution is the module's own traffic). Returns the hook handles (call `.remove()`)."""
    handles = []
    for name, module in modules.items():
        handles += [module.register_forward_pre_hook(lambda m, a, n=name: setattr(counter, "tag", f"{n} fwd"), prepend=True),
                    module.register_full_backward_pre_hook(lambda m, g, n=name: setattr(counter, "tag", f"{n} bwd"),
                                                           prepend=True)]
    return handles


# --- the cost model ------------------------------------------------------------------------------------------
def _run(kind: str, payload: int, n: int, group=None, device="cpu"):
    """One blocking collective of `kind` whose payload is `payload` bytes of fp32."""
    numel = max(n, payload // 4 // n * n)
    if kind == "all_reduce":
        dist.all_reduce(torch.ones(numel, device=device), group=group)
    elif kind == "all_gather":  # torch 2.13's names; all_gather_into_tensor / reduce_scatter_tensor before
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(
            torch.empty(numel, device=device), torch.ones(numel // n, device=device), group=group)
    elif kind == "reduce_scatter":
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(
            torch.empty(numel // n, device=device), torch.ones(numel, device=device), group=group)
    else:
        raise ValueError(f"no sweep for {kind!r}: choose from {', '.join(FITTED)}")


def time_collective(kind: str, payload: int, group=None, device="cpu") -> float:
    """Seconds of one `kind` of `payload` bytes on this rank, started together (a barrier first): every rank calls it."""
    n = dist.get_world_size(group)
    dist.barrier(group=group)
    start = time.perf_counter()
    _run(kind, payload, n, group, device)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def sweep(sizes, kinds=FITTED, repeat: int = 5, group=None, device="cpu") -> tuple[dict, dict]:
    """Time each collective over `sizes` (bytes) and fit α + β·S: ({kind: [[bytes, seconds], ...]}, {kind: fit}).
    Each point is the median of `repeat` calls (after a warm-up round), the slowest rank's; the rounds go through
    every kind and size in turn, so a burst of other work on the machine spreads over all points. Every rank calls it."""
    if len(set(sizes)) < 2:
        raise ValueError(f"a sweep needs at least two message sizes to fit α and β, got {list(sizes)}")
    grid = [(kind, int(s)) for kind in kinds for s in sizes]
    times = {point: [] for point in grid}
    for rep in range(repeat + 1):
        for kind, size in grid:
            t = time_collective(kind, size, group, device)
            if rep:
                times[(kind, size)].append(t)
    medians = torch.tensor([statistics.median(times[p]) for p in grid], dtype=torch.float64,
                           device=collective_device(group))  # nccl reduces GPU tensors only
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
    points = {kind: [[size, medians[grid.index((kind, size))].item()] for size in map(int, sizes)] for kind in kinds}
    return points, {kind: fit_alpha_beta(p) for kind, p in points.items()}


def fit_alpha_beta(points) -> dict:
    """Fit t = α + β·S to [[S, t], ...], minimizing the relative error (small and large messages count
    alike). Returns {"alpha": seconds, "beta": seconds per byte, "max_rel_err": worst point}."""
    def weighted_sum(f):  # weights 1/t²: each point's relative error counts
        return sum(f(s, t) / t**2 for s, t in points)

    sw, sx, sy = weighted_sum(lambda s, t: 1), weighted_sum(lambda s, t: s), weighted_sum(lambda s, t: t)
    sxx, sxy = weighted_sum(lambda s, t: s * s), weighted_sum(lambda s, t: s * t)
    beta = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    alpha = (sy - beta * sx) / sw
    worst = max(abs(alpha + beta * s - t) / t for s, t in points)
    return {"alpha": alpha, "beta": beta, "max_rel_err": worst}


LIKE = {"reduce": "reduce_scatter", "broadcast": "all_gather"}  # priced as the fitted kind that sends as much


def predict_seconds(calls, fits: dict) -> float:
    """α + β·S summed over the calls (Call objects or their dicts) of the fitted kinds (a reduce priced as a
    reduce-scatter, a broadcast as an all-gather: a ring sends as much for each)."""
    pairs = ((c.kind, c.payload) if isinstance(c, Call) else (c["kind"], c["payload"]) for c in calls)
    return sum(fits[k]["alpha"] + fits[k]["beta"] * s for k, s in ((LIKE.get(k, k), s) for k, s in pairs) if k in fits)


def ledger_volume(ledger, strategy: str, measured: float, theory: float, exact: bool = True, note: str = ""):
    """Record `comm_bytes_<strategy>` (counted) beside `comm_bytes_<strategy>_theory` (the formula), and assert
    they agree within 5% where the formula is exact (a claim). `exact=False` (the formula is a bound, not the
    count): an observation beside the formula, not asserted."""
    ledger.record(f"comm_bytes_{strategy}_theory", theory, "B", note=note)
    what = "bytes this rank sent per optimizer step (ring algorithms), counted at the process group"
    if not exact:
        return ledger.observe(f"comm_bytes_{strategy}", measured, "B", predict=theory,
                              note=what + "; the formula is a lower bound here, not the count")
    return ledger.check(f"comm_bytes_{strategy}", measured, "B", expect=theory, rel=0.05, note=what)
