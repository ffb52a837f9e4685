"""Chapter 06's reference solutions (course_lib.workbook.exercises runs each block in the notebook; see README.md)."""

# %% zero3_14b_gib
# hint: the table at the top of the chapter says what ZeRO-3 keeps per rank, and cl.memory has a function for it; cl.memory.count_params counts a config's parameters (cl.models.QWEN25 holds the shapes); mind the unit
# mistake: cl.memory.zero_state_bytes(psi_14b_, 3, 16)["total"] / GB :: GiB: 2**30 bytes, not 1e9
# mistake: cl.memory.zero_state_bytes(psi_14b_, 2, 16)["total"] / 2**30 :: that is ZeRO-2, which keeps every bf16 weight on every GPU; ZeRO-3 shards the weights too
# mistake: 16 * psi_14b_ / 2**30 :: divide by the 16 GPUs: ZeRO-3 shards all of the model states
psi_14b_ = cl.memory.count_params(cl.models.QWEN25["Qwen2.5-14B"])
zero3_14b_gib = cl.memory.zero_state_bytes(psi_14b_, 3, 16)["total"] / 2**30

# %% zero2_offload_7b_gib
# hint: section 5 measured, at N = 2, which model states stay on the device with offload_optimizer (zero2_offload_device_bytes): which of them does ZeRO-2 shard, and which does offload move to the host?
# mistake: (2 * psi_7b_ + 2 * psi_7b_ / 8) / 2**30 :: the gradient slice does not stay: with offload_optimizer each rank's gradients go to the host, where the optimizer steps (section 5 measured the device)
# mistake: 2 * psi_7b_ / GB :: GiB: 2**30 bytes, not 1e9
# mistake: (2 * psi_7b_ + 14 * psi_7b_ / 8) / 2**30 :: that is ZeRO-2 without offload; offload_optimizer moves the optimizer state to the host
psi_7b_ = cl.memory.count_params(cl.models.QWEN25["Qwen2.5-7B"])
zero2_offload_7b_gib = 2 * psi_7b_ / 2**30

# %% persistence_threshold
# hint: section 2's share_kept_whole gives the share a threshold keeps whole for any config; try the powers of ten for each model and keep the largest whose share stays under 1%
# mistake: {"Qwen2.5-0.5B": 1e6, "Qwen2.5-7B": 1e6} :: the 0.5B's matrices are small: at 1e6 elements several of them stay whole (check its share there)
# mistake: {"Qwen2.5-0.5B": 1e5, "Qwen2.5-7B": 1e5} :: the 7B's matrices are larger: a higher threshold still keeps under 1% of it whole
# mistake: {"Qwen2.5-0.5B": 1e3, "Qwen2.5-7B": 1e3} :: the largest threshold that keeps under 1%: the smallest keeps the least, but gathers every tiny tensor (norms, biases) one by one
thresholds_ = [10.0**k for k in range(3, 9)]
persistence_threshold = {m_: max(t_ for t_ in thresholds_ if share_kept_whole(cl.models.QWEN25[m_], t_) < 0.01)
                         for m_ in ("Qwen2.5-0.5B", "Qwen2.5-7B")}

# %% ZeroOneAdamW
# build: yes
# hint: which rank owns which parameter must be the same answer on every rank; after a step, how does a rank learn the new values of the parameters it does not own?
import torch
import torch.distributed as dist


class ZeroOneAdamW:
    def __init__(self, params, lr=1e-3, weight_decay=0.0):
        self.params = list(params)
        rank, world = dist.get_rank(), dist.get_world_size()
        self.owner = [i % world for i in range(len(self.params))]
        own = [p for p, r in zip(self.params, self.owner) if r == rank]
        self.optimizer = torch.optim.AdamW(own, lr=lr, weight_decay=weight_decay)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        self.optimizer.step()
        for p, r in zip(self.params, self.owner):
            dist.broadcast(p.data, src=r)
