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


def local_shard(full: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's slice of a full tensor (to compare a sharded gradient with the unsplit one)."""
    rank, world = _rank_world(group)
    return full.chunk(world, dim=dim)[rank]
