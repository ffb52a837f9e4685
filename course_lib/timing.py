"""Timing: a device-synchronizing timer, tokens/s, and model-FLOPs utilization (MFU).

FLOPs per token of training follow the PaLM paper's estimate, 6N + 12·L·h·s (forward + backward,
the second term for attention scores). Introduced in chapter 00; chapters 01, 03, 05, 10, 11 and
12 time with it.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from .env import native_stderr_silenced

# Dense 16-bit tensor-core peaks (FLOP/s) from the vendors' data sheets, for MFU on GPUs.
GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
                 "L4": 121e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12}


def synchronize(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


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
