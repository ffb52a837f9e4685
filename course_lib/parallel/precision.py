"""Mixed precision in PyTorch: which 16-bit type to use here, autocast and GradScaler set up once.

Chapter 01 ("Mixed precision in PyTorch") explains and measures all of this; later chapters train with

    dtype = cl.precision.autocast_dtype(device)          # bf16 where it runs, fp16 on old GPUs
    with cl.precision.autocast(device, dtype): loss = model(**batch).loss
    scaler = cl.precision.grad_scaler(device, dtype)     # a real scaler only for fp16

The same code runs fp32 (`dtype=torch.float32` switches autocast and the scaler off).
"""
from __future__ import annotations

from collections import defaultdict

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def short_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bf16" (the names the course and the ledgers use)."""
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    return str(dtype).replace("torch.", "")


def format_table() -> dict:
    """Range and precision of fp32, bf16 and fp16 from `torch.finfo` (chapter 01, section 1)."""
    table = {}
    for name, dt in DTYPES.items():
        fi = torch.finfo(dt)
        table[name] = {"bits": fi.bits, "mantissa_bits": round(-torch.log2(torch.tensor(fi.eps)).item()),
                       "max": fi.max, "min_normal": fi.tiny, "min_subnormal": fi.smallest_normal * fi.eps,
                       "eps": fi.eps}
    return table


def autocast_dtype(device: torch.device | str) -> torch.dtype:
    """The 16-bit type to autocast to: bf16 on CPUs (it runs everywhere, see `cl.native_bf16` for
    whether it is fast) and on GPUs that support it; fp16 (with a GradScaler) on older GPUs."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def autocast(device: torch.device | str, dtype: torch.dtype):
    """`torch.autocast` for `device`'s type; `dtype=torch.float32` turns it off (plain fp32)."""
    device = torch.device(device)
    return torch.autocast(device_type=device.type, dtype=dtype if dtype != torch.float32 else None,
                          enabled=dtype != torch.float32)


def grad_scaler(device: torch.device | str, dtype: torch.dtype, **kwargs) -> torch.amp.GradScaler:
    """`torch.amp.GradScaler` (the current API, not `torch.cuda.amp`), enabled only for fp16: bf16 and
    fp32 share fp32's exponent range, so their small gradients do not underflow. Disabled, it passes
    everything through, so one training loop serves all three."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=dtype == torch.float16, **kwargs)


def saved_by_module(model: torch.nn.Module, forward) -> dict:
    """Bytes autograd saves for backward while `forward()` runs, keyed by (module class, dtype).

    Each saved storage counts once, under the innermost module running when it was saved ("(loss)"
    outside every module, e.g. HF's loss). The model's own parameters are skipped; 16-bit copies
    that autocast makes of them are counted (they live until backward). Returns (table, output).
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack, seen, table = ["(loss)"], set(), defaultdict(int)

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            table[(stack[-1], short_name(t.dtype))] += t.untyped_storage().nbytes()
        return t.detach()  # not `t`: an op's saved output would hold its own graph node, a cycle that outlives `out`

    def enter(module, args):
        stack.append(type(module).__name__)

    def leave(module, args, output):
        stack.pop()

    hooks = [h for m in model.modules() if m is not model
             for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
    finally:
        for h in hooks:
            h.remove()
    return dict(table), out


# --- how closely two computations of one result agree, at the matmul precision in force (chapters 03, 04) ----------
FP32_ROUNDOFF = 2.0**-24  # unit roundoff of fp32: half its eps
_ROUNDOFF = {"ieee": FP32_ROUNDOFF, "tf32": 2.0**-11, "bf16": 2.0**-8}  # TF32 keeps 10 of fp32's 23 mantissa bits


def matmul_precision(device: torch.device | str, dtype: torch.dtype = torch.float32) -> tuple[str, float, float]:
    """The precision `dtype` matmuls run at on `device`, as this kernel is set now: (name, u, u_sum), the unit
    roundoff of the operands as the hardware multiplies them and of the sums it accumulates.

    float32 on CUDA: TF32 (u = 2^-11) when `torch.backends.cuda.matmul` allows it (`allow_tf32`, or `fp32_precision`
    "tf32"; the gpu profile turns it on in `presets.preset`), else fp32 (2^-24); on the CPU, fp32 unless oneDNN's
    `fp32_precision` says "bf16" or "tf32". The sums stay fp32. 16-bit operands: their own roundoff, summed in fp32
    unless CUDA's reduced-precision reductions are allowed."""
    device = torch.device(device)
    if dtype != torch.float32:
        u = torch.finfo(dtype).eps / 2
        reduced = device.type == "cuda" and {
            torch.float16: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
            torch.bfloat16: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}.get(dtype, False)
        return short_name(dtype) + (" (16-bit sums)" if reduced else ""), u, u if reduced else FP32_ROUNDOFF
    if device.type == "cuda":
        mode = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")  # torch 2.9+; "none": the older flag rules
        if mode not in _ROUNDOFF:
            mode = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    else:
        mkldnn = getattr(torch.backends.mkldnn, "matmul", None)
        mode = getattr(mkldnn, "fp32_precision", "none")
        mode = mode if mode in _ROUNDOFF else "ieee"
    return {"ieee": "fp32", "tf32": "TF32", "bf16": "bf16"}[mode], _ROUNDOFF[mode], FP32_ROUNDOFF


def matmul_rel_tolerance(device: torch.device | str, matmuls: int, reduction: int,
                         dtype: torch.dtype = torch.float32) -> float:
    """How far two computations of one result may differ (relative, in norm: |a - b| / |b|) when they run other
    kernels, for another batch split, memory layout or chunking, at the precision in force (`matmul_precision`).

    Each matmul's result is off by about u, the roundoff of its operands; through `matmuls` matmuls in a row
    independent errors add in quadrature, √matmuls·u; a sum of `reduction` terms adds about √reduction·u_sum; two
    computations, each with such an error, differ by at most twice that: 2·(√matmuls·u + √reduction·u_sum). In fp32
    the sums dominate; under TF32 the operands, 8,192 times coarser. Chapter 03 (sections 9 and 10) and chapter 04
    (section 1) compare gradients with it."""
    _, u, u_sum = matmul_precision(device, dtype)
    return 2 * (matmuls**0.5 * u + reduction**0.5 * u_sum)
