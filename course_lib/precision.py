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
        return t

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
