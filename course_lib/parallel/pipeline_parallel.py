"""Pipeline parallelism: a Qwen2 model cut into stages, the GPipe schedule and its bubble. Chapter 08.

GPipe (Huang et al., 2019) splits a batch into m micro-batches and runs all forwards, then all
backwards ("all-forward-all-backward"). With p equal stages, each taking t_f + t_b per micro-batch,
a step lasts (m + p − 1)(t_f + t_b) but each stage is busy only m(t_f + t_b) of it: the idle share,
the *bubble*, is (p − 1)/(m + p − 1). `gpipe_schedule` lays the schedule out in time units;
`record_compute` timestamps what a real `torch.distributed.pipelining` stage does, so the recipe
(`course_lib/recipes/pp.py`) can measure the bubble instead of quoting it.

1F1B (PipeDream-Flush) has the same bubble but starts each micro-batch's backward as soon as it can:
stage s holds at most p − s micro-batches' activations instead of m. `InFlight` counts, on a real
stage, the micro-batches forwarded and not yet backwarded and the activation bytes autograd keeps.
"""
from __future__ import annotations

import time
from collections import Counter

import torch
import torch.nn as nn

from ..timing import now


def bubble_fraction(p: int, m: int) -> float:
    """GPipe's idle share of a step with p equal stages and m micro-batches: (p − 1)/(m + p − 1)."""
    if p < 1 or m < 1:
        raise ValueError(f"need p >= 1 stages and m >= 1 micro-batches, got p={p}, m={m}")
    return (p - 1) / (m + p - 1)


def gpipe_schedule(p: int, m: int, t_f=1.0, t_b=2.0) -> list[list[tuple]]:
    """Ideal GPipe timeline: for each stage, (start, end, "F"/"B", micro-batch) with no communication cost.

    Stage s runs forward i once stage s−1 finished it and stage s finished forward i−1; the backward
    runs in the same order from the last stage back (backward takes ~2× the forward's work).
    `t_f`, `t_b`: one duration for all stages, or one per stage (unequal stages).
    """
    t_f = [float(t_f)] * p if isinstance(t_f, (int, float)) else [float(t) for t in t_f]
    t_b = [float(t_b)] * p if isinstance(t_b, (int, float)) else [float(t) for t in t_b]
    end_f = [[0.0] * m for _ in range(p)]
    end_b = [[0.0] * m for _ in range(p)]
    timeline = [[] for _ in range(p)]
    for s in range(p):
        for i in range(m):
            start = max(end_f[s - 1][i] if s else 0.0, end_f[s][i - 1] if i else 0.0)
            end_f[s][i] = start + t_f[s]
            timeline[s].append((start, end_f[s][i], "F", i))
    for s in reversed(range(p)):
        for i in range(m):
            ready = end_b[s + 1][i] if s < p - 1 else end_f[p - 1][m - 1]
            start = max(ready, end_b[s][i - 1] if i else 0.0, end_f[s][m - 1])
            end_b[s][i] = start + t_b[s]
            timeline[s].append((start, end_b[s][i], "B", i))
    return timeline


def schedule_bubble(timeline: list[list[tuple]]) -> list[float]:
    """Each stage's idle share of a timeline from `gpipe_schedule`."""
    makespan = max(end for events in timeline for _, end, *_ in events)
    return [1 - sum(end - start for start, end, *_ in events) / makespan for events in timeline]


def stage_times(log: list, m: int) -> tuple[float, float]:
    """Mean forward (loss included) and backward seconds per micro-batch of one measured stage."""
    fwd = sum(e[2] - e[1] for e in log if e[0] in ("F", "L"))
    bwd = sum(e[2] - e[1] for e in log if e[0] == "B")
    return fwd / m, bwd / m


def on_one_clock(runs: list[dict]) -> list[list[tuple]] | None:
    """The stages' timelines of one measured step on one clock, or None when the ranks kept different steps.

    `runs`: each rank's kept step from the recipe (`timeline` of (kind, start, end) relative to that rank's own
    start, `step_s` = end − start, `step_all` = every timed step's step_s). The step's end is common to the ranks
    (the last one's finish), so `t − step_s` is each time before that end, the same clock for every rank. Each rank
    kept its fastest step; where two ranks kept different repetitions their timelines cannot be set side by side.
    """
    kept = {r["step_all"].index(min(r["step_all"])) for r in runs}
    if len(kept) > 1:
        return None
    return [[(kind, a - r["step_s"], b - r["step_s"]) for kind, a, b in r["timeline"]] for r in runs]


def waits_broken(timelines: list[list[tuple]], m: int, eps: float = 1e-6) -> tuple[int, int]:
    """How many of a pipeline's waits a measured step broke, of how many: (broken, checked).

    `timelines`: one per stage, in stage order, on one clock (`on_one_clock`). Stage s + 1 can start forward i only
    once stage s has finished it (it needs the activations), and stage s can start backward i only once stage s + 1
    has finished it (it needs their gradient). GPipe and 1F1B run the micro-batches in index order on every stage,
    so the i-th forward (backward) of a stage is micro-batch i. This holds whatever the stages' speeds, on any
    machine: a broken wait means the timestamps or the schedule are not what the bubble's count assumes.
    """
    fwd = [[e for e in tl if e[0] == "F"] for tl in timelines]
    bwd = [[e for e in tl if e[0] == "B"] for tl in timelines]
    if any(len(events) != m for events in fwd + bwd):
        raise ValueError(f"expected {m} forwards and {m} backwards per stage, got "
                         f"{[len(e) for e in fwd]} and {[len(e) for e in bwd]}")
    broken = checked = 0
    for s in range(len(timelines) - 1):
        for before, after in zip(fwd[s], fwd[s + 1]):  # activations go down the stages
            broken, checked = broken + (after[1] < before[2] - eps), checked + 1
        for before, after in zip(bwd[s + 1], bwd[s]):  # gradients come back up
            broken, checked = broken + (after[1] < before[2] - eps), checked + 1
    return broken, checked


def layer_ranges(num_layers: int, p: int) -> list[tuple[int, int]]:
    """Split `num_layers` decoder layers into p contiguous, near-equal ranges."""
    if num_layers < p:
        raise ValueError(f"cannot cut {num_layers} layers into {p} stages")
    bounds = [round(k * num_layers / p) for k in range(p + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class Qwen2Stage(nn.Module):
    """One pipeline stage of a `Qwen2ForCausalLM`: its decoder layers [lo, hi), plus the token
    embedding on the first stage and the final norm and output head on the last.

    Each stage rebuilds the rotary position embeddings itself (cheap), so only the hidden states
    cross the stage boundary. No attention mask: SDPA then applies the causal mask itself.
    With tied embeddings the first and last stages each hold the shared matrix; their gradients
    must be summed across the two stages (Megatron's "embedding group").
    """

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): inner.layers[i] for i in range(lo, hi)})  # keep the global names
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        pe = self.rotary_emb(h, pos)
        for layer in self.layers.values():
            h = layer(h, attention_mask=None, position_embeddings=pe, position_ids=pos)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def qwen2_stage(model: nn.Module, stage: int, p: int) -> Qwen2Stage:
    """Stage `stage` of `p` of a Qwen2 causal LM (layers split evenly)."""
    lo, hi = layer_ranges(model.config.num_hidden_layers, p)[stage]
    return Qwen2Stage(model, lo, hi, first=stage == 0, last=stage == p - 1)


def full_name(stage_param_name: str) -> str:
    """A stage's parameter name as the unsplit model names it (to compare gradients)."""
    if stage_param_name.startswith("lm_head."):
        return stage_param_name
    return "model." + stage_param_name


def record_compute(stage, log: list, loss_fn=None):
    """Timestamp every compute a `torch.distributed.pipelining` stage does (forward and backward
    of each micro-batch; the loss too if `loss_fn` is given): appends (kind, start, end, cpu) to
    `log`: wall-clock times from `time.perf_counter()` (one clock for all processes of a machine), read
    once the GPU finished (`cl.timing.now`: backward's kernels are queued by autograd's worker thread and
    still run when the call returns), and the CPU seconds the thread really computed. Returns the wrapped loss_fn.

    Everything between these intervals (waiting for a neighbour, sending, receiving) is idle time.
    cpu / (end − start) below 1 means the rank was waiting for a core: the machine is shared, and
    wall-clock busy and idle times no longer describe the schedule.
    """
    def timed(fn, kind):
        def run(*args, **kwargs):
            start, cpu = now(), time.thread_time()
            out = fn(*args, **kwargs)
            log.append((kind, start, now(), time.thread_time() - cpu))
            return out
        return run

    stage.forward_one_chunk = timed(stage.forward_one_chunk, "F")
    stage.backward_one_chunk = timed(stage.backward_one_chunk, "B")
    return timed(loss_fn, "L") if loss_fn is not None else None


def idle_fraction(log: list, start: float, end: float) -> float:
    """Share of the window [start, end] in which this rank computed nothing."""
    busy = sum(entry[2] - entry[1] for entry in log)
    return 1.0 - busy / (end - start)


def cpu_share(log: list) -> float:
    """CPU seconds over wall seconds of the compute intervals: ≈ 1 when the rank had its core."""
    return sum(entry[3] for entry in log) / sum(entry[2] - entry[1] for entry in log)


class InFlight:
    """On one `torch.distributed.pipelining` stage: how many micro-batches are in flight (forwarded, not yet
    backwarded) and how many bytes autograd keeps for their backward (saved-tensor hooks; a storage counts
    once, parameters not at all), now and at the peak. Wraps the stage's forward and backward, and the loss.

        flight = InFlight(stage); loss_fn = flight.wrap_loss(loss_fn)    # before building the schedule
        ... schedule.step(...) ...; flight.peak_micro_batches, flight.peak_bytes
    """

    def __init__(self, stage, loss_fn=None):
        self.params = {p.untyped_storage().data_ptr() for p in stage.submod.parameters()}
        self.refs, self.sizes = Counter(), {}
        self.micro_batches = self.peak_micro_batches = self.bytes = self.peak_bytes = 0
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def forward_one_chunk(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                out = forward(*args, **kwargs)
            self.micro_batches += 1
            self.peak_micro_batches = max(self.peak_micro_batches, self.micro_batches)
            return out

        def backward_one_chunk(*args, **kwargs):
            out = backward(*args, **kwargs)
            self.micro_batches -= 1
            return out

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk

    def wrap_loss(self, loss_fn):
        def loss(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return loss_fn(*args, **kwargs)
        return loss

    def reset(self) -> None:
        self.peak_micro_batches, self.peak_bytes = self.micro_batches, self.bytes

    def _pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key in self.params:
            return t
        self.refs[key] += 1
        if self.refs[key] == 1:
            self.sizes[key] = t.untyped_storage().nbytes()
            self.bytes += self.sizes[key]
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        return _Held(t, key, self)

    @staticmethod
    def _unpack(held):
        return held.t if isinstance(held, _Held) else held

    def _release(self, key) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.bytes -= self.sizes.pop(key)
            del self.refs[key]


class _Held:
    """A saved tensor; when autograd lets it go (after backward, or with the graph), its bytes are released."""
    __slots__ = ("t", "key", "owner")

    def __init__(self, t, key, owner):
        self.t, self.key, self.owner = t, key, owner

    def __del__(self):
        self.owner._release(self.key)
