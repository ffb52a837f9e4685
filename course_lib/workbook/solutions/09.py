"""Chapter 09's reference solutions (course_lib.workbook.exercises runs each block in the notebook; see README.md)."""

# %% lora_r64_7b
# hint: every adapted d_in × d_out matrix trains A (r × d_in) and B (d_out × r), in each of the 7B's 28 layers; section 3 wrote that sum once, for any config and rank
# mistake: lora_params(q7, 64, ["q_proj", "v_proj"]) :: all seven projections, not only q and v
# mistake: lora_params(q7, 64) // q7["num_hidden_layers"] :: every one of the 28 layers has its own adapters
# mistake: 2 * lora_params(q7, 64) :: r·(d_in + d_out) a matrix: A and B together, counted once
lora_r64_7b = lora_params(q7, 64)

# %% lora_qv_percent
# hint: the share of everything the 7B holds that LoRA trains when only two projections get adapters; the counter of section 3 takes the projections to adapt
# printed: 0.001
# mistake: lora_params(q7, 8, ["q_proj", "v_proj"]) / psi7 :: a percentage: multiply the fraction by 100
# mistake: 100 * lora_params(q7, 8) / psi7 :: only q_proj and v_proj, as the original LoRA paper did
lora_qv_percent = 100 * lora_params(q7, 8, ["q_proj", "v_proj"]) / psi7

# %% lora_r4_optimizer_bytes
# hint: AdamW keeps state only for what trains: something per trained parameter and something per trained tensor (chapter 01 counted both); which tensors does LoRA add beside each adapted projection, and how many projections does this model adapt?
# mistake: 8 * lora_params(cfg_, 4) :: AdamW also keeps one 4-byte step counter per trained tensor (A and B of every adapted projection)
# mistake: 8 * sum(p.numel() for p in model.parameters()) :: LoRA trains only the adapters: the frozen base has no optimizer state
# mistake: 12 * lora_params(cfg_, 4) + 4 * 2 * len(TARGETS) * cfg_["num_hidden_layers"] :: the adapters are fp32 already: no master copy, only the two moments
cfg_ = model.config.to_dict()
lora_r4_optimizer_bytes = 8 * lora_params(cfg_, 4) + 4 * 2 * len(TARGETS) * cfg_["num_hidden_layers"]

# %% LoRALinear
# build: yes
# hint: the frozen layer's output plus (alpha / r) times x through A then B; only A and B train, and B starts at zero
import math

import torch
from torch import nn

class LoRALinear(nn.Module):
    def __init__(self, base, r, alpha):
        super().__init__()
        self.base, self.scale = base, alpha / r
        self.base.requires_grad_(False)
        self.A = nn.Parameter(torch.empty(r, base.in_features))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + self.scale * (x @ self.A.T @ self.B.T)
