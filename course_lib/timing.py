"""Timing: a device-synchronizing timer, tokens/s, and model-FLOPs utilization (MFU).

FLOPs per token of training follow the PaLM paper's estimate, 6N + 12·L·h·s (forward + backward,
the second term for attention scores). Introduced in chapter 00; chapters 01, 03, 05, 10, 11 and
12 time with it.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch

from .env import native_stderr_silenced, pick_device

# Dense 16-bit tensor-core peaks (FLOP/s) from the vendors' data sheets (the sparse figures halved), for MFU on GPUs.
# Matched as a substring of the device's name, first match wins: the PCIe and NVL cards before their SXM namesakes,
# "A100" before "A10". V100 and T4 have no bf16: their fp16 peak.
GPU_PEAK_BF16 = {"H200 NVL": 835e12, "H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12,
                 "A100": 312e12, "L40S": 362e12, "A10": 125e12, "L4": 121e12, "RTX 4090": 165e12,
                 "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12}


def synchronize(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def now(device: torch.device | str | None = None) -> float:
    """`time.perf_counter()` once the GPU finished what was queued: host clocks around GPU work otherwise time
    the launches, not the work. The timelines of chapters 05 (buckets), 07 and 08 (bubble) read it."""
    synchronize(device)
    return time.perf_counter()


class Timer:
    """`with Timer() as t: ...` then `t.seconds`. Waits for the GPU before and after."""

    def __enter__(self):
        synchronize()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        synchronize()
        self.seconds = time.perf_counter() - self._start
        return False


def time_it(fn, repeat: int = 3, warmup: int = 1) -> float:
    """Median seconds of `fn()` over `repeat` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        with Timer() as t:
            fn()
        times.append(t.seconds)
    return sorted(times)[len(times) // 2]


class Spread:
    """Seconds of one variant over repeated, interleaved runs: the median and the range (fastest, slowest).

    Time on a shared machine has a spread; a comparison is only as good as it. `interleaved` gives each variant its
    samples under the same background load; `verdict` and `compare` say "faster" or "slower" only when the two
    ranges do not overlap."""

    def __init__(self, samples):
        self.samples = sorted(float(s) for s in samples)
        if not self.samples:
            raise ValueError("a Spread needs at least one sample")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def lo(self) -> float:
        return self.samples[0]

    @property
    def hi(self) -> float:
        return self.samples[-1]

    def as_dict(self) -> dict:
        """What a ledger row keeps of it (`Ledger.observe(..., spread=...)`)."""
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": len(self.samples)}

    def __repr__(self) -> str:
        return f"Spread(median={self.median:.4g}, range={self.lo:.4g}-{self.hi:.4g}, n={len(self.samples)})"


def spread(samples) -> Spread:
    return samples if isinstance(samples, Spread) else Spread(samples)


def interleaved(variants: dict, repeat: int = 5, warmup: int = 1) -> dict[str, Spread]:
    """{name: Spread} of each `variants[name]()` timed `repeat` times in turns (A B C, A B C, ...) after `warmup`
    untimed turns, the GPU synchronized around each call: a burst of other work on the machine falls on every
    variant alike instead of on whichever ran at that moment."""
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    samples = {name: [] for name in variants}
    for _ in range(repeat):
        for name, fn in variants.items():
            with Timer() as t:
                fn()
            samples[name].append(t.seconds)
    return {name: Spread(s) for name, s in samples.items()}


def verdict(a, b) -> str:
    """"faster" if every run of `a` took less time than every run of `b`, "slower" if every run took more, else
    "indistinguishable" (the ranges overlap). With 5 interleaved runs each, two variants that are really the same
    separate by chance in 2 of the 252 ways their ten times can be ordered (under 1%)."""
    a, b = spread(a), spread(b)
    if a.hi < b.lo:
        return "faster"
    if a.lo > b.hi:
        return "slower"
    return "indistinguishable"


def _num(x: float, extra: int = 0) -> str:
    """Three significant figures (whole numbers from 100 up), `extra` more digits when rounding would hide a gap."""
    if abs(x) >= 100:
        return f"{x:.{extra}f}"
    return f"{x:.{3 + extra}g}"


def _span(x: Spread, scale: float, unit: str, extra: int = 0) -> str:
    n = lambda v: _num(v * scale, extra)  # noqa: E731
    return f"median {n(x.median)} {unit}, range {n(x.lo)}–{n(x.hi)}"


def compare(a, b, name_a: str, name_b: str, unit: str = "ms") -> str:
    """One sentence comparing two variants' times, its word from `verdict`, the spreads it rests on inside it:

    "bf16 ran 1.14× faster than fp32 (bf16: median 10.2 ms, range 9.8–10.5; fp32: median 11.6 ms, range 11.0–12.1)"
    "bf16 and fp32 are indistinguishable here (bf16: median ...; fp32: ...)"

    Every sentence of a chapter that compares times is written by this function (or carries a label saying where its
    figure comes from): tests/test_prose.py reads the ranges back and fails a "faster" whose ranges overlap."""
    a, b = spread(a), spread(b)
    scale = {"s": 1.0, "ms": 1e3, "µs": 1e6}[unit]
    word = verdict(a, b)
    # ranges that do not overlap must not print as touching (1336–1482 against 1153–1336): add digits until the
    # printed ends show the gap the verdict rests on (rounding keeps overlapping ranges overlapping)
    gap = {"faster": (a.hi, b.lo), "slower": (b.hi, a.lo)}.get(word)
    extra = 0
    while gap and extra < 6 and float(_num(gap[0] * scale, extra)) >= float(_num(gap[1] * scale, extra)):
        extra += 1
    spans = f"({name_a}: {_span(a, scale, unit, extra)}; {name_b}: {_span(b, scale, unit, extra)})"
    if word == "indistinguishable":
        return f"{name_a} and {name_b} are indistinguishable here {spans}"
    ratio = b.median / a.median if word == "faster" else a.median / b.median
    return f"{name_a} ran {ratio:.2f}× {word} than {name_b} {spans}"


class Clock:
    """Moments of GPU work, marked without waiting for it: on a GPU `mark()` records a CUDA event on the current
    stream (it fires once the work queued before it is done), on the CPU it reads `time.perf_counter()`;
    `seconds(a, b)` is the time from mark a to mark b (synchronizing first). Chapter 05's bucket timeline marks
    from inside DDP's hooks, where a synchronize would serialize the overlap it shows."""

    def __init__(self, device: torch.device | str | None = None):
        self.cuda = torch.device(device or pick_device()).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        if not self.cuda:
            return b - a
        synchronize()
        return a.elapsed_time(b) / 1e3  # milliseconds between the events


def timed(fn, warmup: int = 1):
    """`fn()`'s result and the seconds of its last call, after `warmup` untimed calls (the first call pays for
    set-up: lazy initialization, cuBLAS handles, the allocator's first pages), the GPU synchronized around it."""
    for _ in range(warmup):
        fn()
    with Timer() as t:
        out = fn()
    return out, t.seconds


def tokens_per_second(tokens: int, seconds: float) -> float:
    return tokens / seconds


def flops_per_token(num_params: float, layers: int, hidden: int, seq: int) -> float:
    """Training FLOPs per token: 6N (matmuls, fwd + bwd) + 12·L·h·s (attention scores)."""
    return 6 * num_params + 12 * layers * hidden * seq


def peak_flops(device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The device's peak FLOP/s: data-sheet value for known GPUs, measured matmul rate on a CPU."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_BF16.items():
            if key in name:
                return value if dtype in (torch.bfloat16, torch.float16) else None
        return None
    return matmul_flops(dtype=dtype, device=device)


def matmul_flops(n: int = 1024, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> float:
    """Measured FLOP/s of an n×n matmul: the practical peak for MFU where no data sheet applies."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    seconds = time_it(lambda: a @ b, repeat=3, warmup=1)
    return 2 * n**3 / seconds


def mfu(tokens_per_s: float, flops_per_tok: float, peak: float) -> float:
    """Model-FLOPs utilization: achieved training FLOP/s over the device's peak."""
    return tokens_per_s * flops_per_tok / peak


def op_share(prof, keys, device: torch.device | str) -> tuple[float, float]:
    """(µs in the ops whose name contains one of `keys`, µs in all) of a recorded profile, each moment counted
    once: on a GPU the kernels' time (the device rows; an aten op's device time is its kernels' again, so a sum
    over every row counts each kernel twice), on the CPU self time (an op's total includes its children's).
    Chapter 12."""
    from torch.autograd import DeviceType

    ops = prof.key_averages()
    if torch.device(device).type == "cuda":
        total = sum(e.self_device_time_total for e in ops if e.device_type == DeviceType.CUDA)
        hit = sum(e.self_device_time_total for e in ops if e.device_type == DeviceType.CPU and any(k in e.key for k in keys))
        return hit, total
    return (sum(e.self_cpu_time_total for e in ops if any(k in e.key for k in keys)),
            sum(e.self_cpu_time_total for e in ops))


@contextmanager
def quiet_profile(**kwargs):
    """`torch.profiler.profile(**kwargs)` (default: CPU events), minus the lines its native tracer prints to
    stderr on start and stop (kineto's "profiler_start/stop", "USDT:"). Chapters 07 and 12."""
    kwargs.setdefault("activities", [torch.profiler.ProfilerActivity.CPU])
    prof = torch.profiler.profile(**kwargs)
    with native_stderr_silenced():
        prof.__enter__()
    try:
        yield prof
    finally:
        with native_stderr_silenced():
            prof.__exit__(None, None, None)
