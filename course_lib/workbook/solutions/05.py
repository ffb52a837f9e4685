"""Chapter 05's reference solutions (course_lib.workbook.exercises runs each block in the notebook; see README.md)."""

# %% ddp_token_weight
# hint: DDP's averaged gradient is (w0·g0 + w1·g1) / 2, each g the mean over that rank's own tokens; the gradient of the mean over all 160 tokens is (120·g0 + 40·g1) / 160: match the two rank by rank
# mistake: {"rank0": 120 / 160, "rank1": 40 / 160} :: DDP divides the sum of the ranks' gradients by N = 2: each factor has to undo that division
# mistake: {"rank0": 2 * 120 / 160, "rank1": 1.0} :: rank 1 has to rescale too: with its factor left at 1, no factor on rank 0 alone gives the mean over all 160 tokens
# mistake: {"rank0": 1.0, "rank1": 1.0} :: the ranks hold different numbers of target tokens: equal weights over-count rank 1's tokens
ddp_token_weight = {"rank0": 2 * 120 / (120 + 40), "rank1": 2 * 40 / (120 + 40)}

# %% no_sync_elements
# hint: section 6 printed both counts for its own number of micro-batches (P_ranks.accum): which of the two grows with the number of micro-batches, and which does not?
# mistake: {"sync_every": R["params"], "no_sync": R["params"]} :: without no_sync each of the 8 micro-batches' backward all-reduces
# mistake: {"sync_every": 8 * R["params"], "no_sync": 0} :: with no_sync the last micro-batch still all-reduces (once)
no_sync_elements = {"sync_every": 8 * R["params"], "no_sync": R["params"]}

# %% buckets_at_2mib
# hint: make your rule reproduce section 7 first: its buckets at the small cap (small["sizes"]) show which layers' gradients fill the first bucket, and that a bucket may hold more than the cap
# mistake: buckets_by_(sizes_) :: that is the count for a walk from the first parameter to the last, or for buckets that never pass the cap: DDP fills buckets in the order backward produces the gradients (last layers first) and closes one once it reaches the cap (section 7's buckets pass it)
# mistake: buckets_by_(sizes_[::-1], bytes_per=2) :: one bucket would hold all the gradients: fp32 gradients take 4 bytes an element, 4Ψ bytes in all, more than 2 MiB
sizes_ = [p.numel() for p in cl.models.tiny_qwen2(**P_ranks.model).parameters()]

def buckets_by_(order, cap=2 * 2**20, bytes_per=4):
    count, current = 0, 0
    for n in order:
        current += n
        if bytes_per * current >= cap:
            count, current = count + 1, 0
    return count + (1 if current else 0)

buckets_at_2mib = buckets_by_(sizes_[::-1])

# %% ddp_from_hooks
# build: yes
# hint: wrap the model (keep it as .module, forward calls it); broadcast every parameter from rank 0 first; then, on each parameter that requires grad, a hook that fires once backward has accumulated its gradient (register_post_accumulate_grad_hook) and replaces p.grad by its sum over the ranks divided by the number of ranks
import torch.distributed as dist
from torch import nn


class HookedDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module, self.world = module, dist.get_world_size()
        for p in module.parameters():  # frozen ones too: every rank starts from rank 0's state
            dist.broadcast(p.data, src=0)
        for p in module.parameters():
            if p.requires_grad:  # a frozen parameter gets no gradient, so no hook
                p.register_post_accumulate_grad_hook(self.average)

    def average(self, p):  # after backward has added this pass's gradient to p.grad (under accumulation: the whole sum)
        dist.all_reduce(p.grad)  # in place: the sum over the ranks
        p.grad /= self.world

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def ddp_from_hooks(model):
    return HookedDDP(model)
