"""Chapter 07's reference solutions (course_lib.workbook.exercises runs each block in the notebook; see README.md)."""

# %% fsdp2_7b_64_gib
# hint: section 5 counted, part by part, what one rank holds in fp32 and what divides it; scale that to Qwen2.5-7B's parameter count (cl.memory.count_params) and 64 ranks; mind the unit
# mistake: 16 * psi_7b_ / 64 / GB :: GiB: 2**30 bytes, not 1e9
# mistake: 16 * psi_7b_ / 2**30 :: FSDP2 shards weights, gradients and optimizer state over all 64 ranks
# mistake: (4 + 12 / 64) * psi_7b_ / 2**30 :: FSDP2 shards the weights too (like ZeRO-3), not only gradients and optimizer state
psi_7b_ = cl.memory.count_params(cl.models.QWEN25["Qwen2.5-7B"])
fsdp2_7b_64_gib = zero_state_bytes(psi_7b_, 3, 64, 4, 4, 8)["total"] / 2**30

# %% all_gathers_24
# hint: count in section 4's traces how often one step gathers each layer, and the root unit, under each setting; then scale the layers to 24
# mistake: {"default": 2 * 24, "keep": 24} :: the root unit (embedding, final norm, head) is gathered too, once
# mistake: {"default": 1 + 24, "keep": 1 + 24} :: by default a layer is freed after its forward and gathered again for its backward
all_gathers_24 = {"default": 1 + 2 * 24, "keep": 1 + 24}

# %% gathered_peak_bf16
# hint: section 4's check gathered_peak_default_bytes names what the default peak holds gathered (root_b and layer_b are its parts, in fp32 bytes); what does param_dtype change in it?
# mistake: root_b + layer_b :: param_dtype=bf16 gathers 2 bytes a parameter instead of 4
# mistake: (root_b + 2 * layer_b) // 2 :: the probe's peak counts the root and one layer swapped in; a prefetched layer waits in its gather buffer, not counted
gathered_peak_bf16 = (root_b + layer_b) / 2  # bytes: to 3 significant figures, like any number not a count

# %% ShardedLinear
# build: yes
# hint: keep this rank's rows as the parameters; a torch.autograd.Function whose forward all-gathers the rows of every rank and whose backward reduce-scatters the whole gradient back to rows, divided by the number of ranks
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard):
        world = dist.get_world_size()
        whole = shard.new_empty((shard.shape[0] * world, *shard.shape[1:]))
        dist.all_gather_into_tensor(whole, shard.contiguous())
        return whole

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size()
        shard = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        dist.reduce_scatter_tensor(shard, grad.contiguous())
        return shard / world


class ShardedLinear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        rows = linear.out_features // world
        self.weight = nn.Parameter(linear.weight.detach()[rank * rows:(rank + 1) * rows].clone())
        self.bias = nn.Parameter(linear.bias.detach()[rank * rows:(rank + 1) * rows].clone())

    def forward(self, x):
        return F.linear(x, GatherRows.apply(self.weight), GatherRows.apply(self.bias))
