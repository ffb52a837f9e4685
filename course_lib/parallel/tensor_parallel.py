"""Tensor parallelism from first principles, the Megatron-LM way (picotron style). Chapter 08.

A linear layer y = x·Wᵀ + b can be split over the ranks of a tensor-parallel group two ways:

- `ColumnParallelLinear`: W split by *output* features (Wᵀ's columns). Every rank sees the whole
  input x and computes its slice y_i = x·W_iᵀ + b_i. Concatenating the slices (all-gather) gives y.
- `RowParallelLinear`: W split by *input* features. Every rank holds the slice x_i of the input and
  computes a partial sum x_i·W_iᵀ; adding the partial sums (all-reduce) gives y, then + b once.

Column then Row needs ONE all-reduce in the forward pass and no gather in between (Megatron's MLP:
gate/up column-parallel, the elementwise SwiGLU on the local slice, down row-parallel; attention:
q/k/v column-parallel by whole heads, attention per local head, o row-parallel).

The collectives are autograd functions, so backward is right too: what is an identity in the
forward pass is an all-reduce in the backward pass, and the other way round (f and g in the
Megatron paper). Launched in `course_lib/recipes/tp.py`.

PyTorch's own API does the same with DTensors: `qwen2_plan(sequence_parallel)` is the plan for one
Qwen2 decoder layer (PyTorch's TP tutorial, with sequence parallelism or without), and
`layer_activation_bytes` counts what one layer keeps for backward per rank (Korthikanti et al. 2022's
accounting, done for this architecture), measured with `cl.SavedTensors` (a DTensor by its local shard).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _rank_world(group) -> tuple[int, int]:
    """(rank, size) in the tensor-parallel group; (0, 1) when running alone."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input's gradient backward (every rank used all of x)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        if _rank_world(ctx.group)[1] > 1:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce (sum of partial results) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        if _rank_world(group)[1] > 1:
            x = x.contiguous()
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dimension forward; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        rank, world = _rank_world(group)
        if world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank, world = _rank_world(ctx.group)
        return grad.chunk(world, dim=-1)[rank].contiguous(), None


def copy_to_tp(x, group=None):
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group=None):
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x, group=None):
    return _GatherFromTP.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """This rank's block of output features: y_i = x·W_iᵀ + b_i (all-gathered to y if `gather_output`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None, gather_output: bool = False):
        super().__init__()
        rank, world = _rank_world(group)
        if out_features % world:
            raise ValueError(f"out_features={out_features} does not split over {world} ranks")
        self.group, self.gather_output = group, gather_output
        self.weight = nn.Parameter(torch.empty(out_features // world, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features // world)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, gather_output: bool = False) -> "ColumnParallelLinear":
        """The shard of an existing full layer that this rank holds (rows of W: output features)."""
        rank, world = _rank_world(group)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group, gather_output)
        layer.to(linear.weight.device)  # where the full layer lives (a GPU): its shard computes there
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(world, dim=0)[rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.chunk(world, dim=0)[rank])
        return layer

    def forward(self, x):
        x = copy_to_tp(x, self.group)  # every rank needs all of x; backward sums the ranks' dx
        y = F.linear(x, self.weight, self.bias)  # [..., out/world]
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """This rank's block of input features: partial = x_i·W_iᵀ; y = all-reduce(partial) + b."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None, input_is_parallel: bool = True):
        super().__init__()
        rank, world = _rank_world(group)
        if in_features % world:
            raise ValueError(f"in_features={in_features} does not split over {world} ranks")
        self.group, self.input_is_parallel = group, input_is_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // world))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None  # added once, after the sum

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, input_is_parallel: bool = True) -> "RowParallelLinear":
        """The shard of an existing full layer that this rank holds (columns of W: input features)."""
        rank, world = _rank_world(group)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group, input_is_parallel)
        layer.to(linear.weight.device)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(world, dim=1)[rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x):
        if not self.input_is_parallel:  # a full input: keep this rank's slice of features
            rank, world = _rank_world(self.group)
            x = x.chunk(world, dim=-1)[rank]
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


def megatron_mlp(mlp: nn.Module, group=None) -> nn.Module:
    """A tensor-parallel copy of a Qwen2 (SwiGLU) MLP: gate/up column-parallel, down row-parallel.

    down(silu(gate(x)) * up(x)): the product is elementwise, so each rank can apply it to its own
    slice of the intermediate features; one all-reduce (in `down`) per forward pass.
    """
    tp = copy.deepcopy(mlp)
    tp.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, group)
    tp.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, group)
    tp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, group)
    return tp


def megatron_attention(attn: nn.Module, group=None) -> nn.Module:
    """A tensor-parallel copy of a Qwen2 attention block: each rank keeps whole heads.

    q/k/v are column-parallel: rank r holds query heads [r·H/t, (r+1)·H/t) and the key/value heads
    those queries share under grouped-query attention (contiguous blocks keep the groups intact).
    Attention runs per local head with no communication; o_proj is row-parallel (one all-reduce).
    """
    rank, world = _rank_world(group)
    heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
    if heads % world or kv_heads % world:
        raise ValueError(f"{heads} query / {kv_heads} key-value heads do not split over {world} ranks")
    tp = copy.deepcopy(attn)
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(tp, name, ColumnParallelLinear.from_linear(getattr(attn, name), group))
    tp.o_proj = RowParallelLinear.from_linear(attn.o_proj, group)
    return tp  # Qwen2Attention reshapes with -1 heads, so it runs on the local heads unchanged


def tp_degrees(model: dict, limit: int = 64) -> list[int]:
    """The tensor-parallel degrees t <= `limit` that split a Qwen2 shape (a `cl.models` size dict) by whole
    heads: t divides the query heads, the key/value heads and the MLP's width. Qwen2.5-0.5B (14 and 2 heads): 1, 2."""
    need = (model["num_attention_heads"], model["num_key_value_heads"], model["intermediate_size"])
    return [t for t in range(1, limit + 1) if all(n % t == 0 for n in need)]


def default_meshes(nproc: int, model: dict) -> list[str]:
    """The (data x model) meshes chapter 08 runs on `nproc` ranks: the widest tensor parallelism the heads allow
    (all ranks when they split) beside pure data parallelism, e.g. 8 ranks of Qwen2.5-0.5B: "4x2", "8x1"."""
    t = max(d for d in tp_degrees(model, nproc) if nproc % d == 0)
    return list(dict.fromkeys([f"{nproc // t}x{t}", f"{nproc}x1"]))


def local_shard(full: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's slice of a full tensor (to compare a sharded gradient with the unsplit one)."""
    rank, world = _rank_world(group)
    return full.chunk(world, dim=dim)[rank]


def qwen2_plan(sequence_parallel: bool = False) -> dict:
    """`parallelize_module` plan for one Qwen2 decoder layer. q/k/v and gate/up column-parallel, o and down
    row-parallel; each block's input is prepared once (`PrepareModuleInput`), so the three (two) column-
    parallel projections share it and backward all-reduces its gradient once per block, as Megatron's f.
    With `sequence_parallel`, the norms run on a slice of the sequence (`SequenceParallel`), each block's input
    is all-gathered from the sequence slices and its output reduce-scattered back to them (Korthikanti et al.)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    seq = Shard(1) if sequence_parallel else Replicate()  # the layout between blocks: [batch, sequence, hidden]
    plan = {"self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                            use_local_output=False),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=False),
            "self_attn.o_proj": RowwiseParallel(output_layouts=seq), "mlp.down_proj": RowwiseParallel(output_layouts=seq)}
    plan.update({f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"})
    plan.update({f"mlp.{n}_proj": ColwiseParallel() for n in ("gate", "up")})
    if sequence_parallel:
        plan.update(input_layernorm=SequenceParallel(), post_attention_layernorm=SequenceParallel())
    return plan


def layer_activation_bytes(batch: int, seq: int, cfg, t: int = 1, sp: str | None = None, elem: int = 4) -> dict:
    """Bytes one Qwen2 decoder layer saves for backward on one rank, counted tensor by tensor (fp32, no dropout,
    SDPA's fused attention, which keeps q, k, v, its output and a log-sum-exp per head and token, no s×s matrix):

    * replicated by tensor parallelism: each RMSNorm's input and output (2·sbh) and its 1/rms (sb), and the
      input of the q/k/v and of the gate/up projections (sbh each); the rotary cos/sin tables;
    * split by t: q (sbh), k and v (sb·kv), the attention output (sbh, also o_proj's input), the log-sum-exp
      (sb·heads), and the MLP's gate, up, silu(gate) and their product (4·sbI).

    `sp="pytorch"` (`SequenceParallel`) splits the norms too; the projections keep the gathered input
    whole. `sp="megatron"` (Korthikanti et al.: the gathered input is stored split and gathered again
    in backward) splits everything but the rotary tables: their 34sbh/t in fp16 GPT terms."""
    b_s, h = batch * seq, cfg.hidden_size
    hd = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * hd
    norms = 2 * (2 * b_s * h + b_s)
    inputs = 2 * b_s * h
    split = b_s * (h + 2 * kv + h + cfg.num_attention_heads + 4 * cfg.intermediate_size)
    rotary = 2 * seq * hd
    if sp == "megatron":
        parts = {"replicated": rotary, "split": (norms + inputs + split) // t}
    elif sp == "pytorch":
        parts = {"replicated": inputs + rotary, "split": (norms + split) // t}
    else:
        parts = {"replicated": norms + inputs + rotary, "split": split // t}
    return {k: v * elem for k, v in parts.items()} | {"total": elem * sum(parts.values())}
