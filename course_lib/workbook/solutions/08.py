"""Chapter 08's reference solutions (course_lib.workbook.exercises runs each block in the notebook; see README.md)."""

# %% bubble_p4_m16
# hint: Megatron's form divides the idle time by the compute time; this chapter's bubble divides it by the whole step, idle time plus compute time
# mistake: (4 - 1) / 16 :: that is the quoted figure itself, (p−1)/m: idle time over compute time, not over the step
# mistake: 100 * 3 / 19 :: a fraction, not a percentage
bubble_p4_m16 = ppl.bubble_fraction(4, 16)

# %% min_micro_batches
# hint: write the bubble for p = 8 as a function of m and find the first m that makes it smaller than 0.05
# mistake: next(m for m in range(1, 100_000) if (8 - 1) / m < 0.05) :: (p−1)/m is idle over useful time; the bubble's share of the step is (p−1)/(m+p−1)
# mistake: next(m for m in range(1, 100_000) if ppl.bubble_fraction(8, m) <= 0.05) :: below 5%, not at it
min_micro_batches = next(m for m in range(1, 100_000) if ppl.bubble_fraction(8, m) < 0.05)

# %% tp_degrees_14b
# hint: tensor parallelism cuts attention by whole heads: both the query heads and the key/value heads of Qwen2.5-14B must split evenly over t ranks
# mistake: [t for t in range(1, 65) if q14_["num_attention_heads"] % t == 0] :: grouped-query attention has fewer key/value heads: without k/v-head replication t must divide those too
# mistake: [1, 2, 4, 8, 16, 32, 64] :: powers of two are not enough: t must divide the numbers of heads
q14_ = cl.models.QWEN25["Qwen2.5-14B"]
tp_degrees_14b = [t_ for t_ in range(1, 65) if q14_["num_attention_heads"] % t_ == 0 and q14_["num_key_value_heads"] % t_ == 0]

# %% tp_mlp
# build: yes
# hint: write down, for forward and for backward, which tensor each rank holds whole and which only in part; a sum over the ranks is needed exactly where a part must become the whole
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class SumInForward(torch.autograd.Function):   # Megatron's g: after the row-parallel linear
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class SumInBackward(torch.autograd.Function):  # Megatron's f: before the column-parallel linear
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class TensorParallelMLP(nn.Module):
    def __init__(self, fc1, fc2):
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        part = fc1.out_features // world
        cut = slice(rank * part, (rank + 1) * part)
        self.fc1 = nn.Linear(fc1.in_features, part)
        self.fc2 = nn.Linear(part, fc2.out_features)
        with torch.no_grad():
            self.fc1.weight.copy_(fc1.weight[cut])
            self.fc1.bias.copy_(fc1.bias[cut])
            self.fc2.weight.copy_(fc2.weight[:, cut])
            self.fc2.bias.copy_(fc2.bias)

    def forward(self, x):
        partial = F.linear(F.gelu(self.fc1(SumInBackward.apply(x))), self.fc2.weight)
        return SumInForward.apply(partial) + self.fc2.bias


def tp_mlp(fc1, fc2):
    return TensorParallelMLP(fc1, fc2)
