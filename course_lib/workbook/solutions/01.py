"""Chapter 01's reference solutions (course_lib.workbook.exercises runs each block in the notebook; see README.md)."""

# %% bf16_ignored_update
# hint: bf16 keeps 8 significant bits: find the gap between 1.0 and the next bf16 number, and remember that rounding to nearest (ties to even) ignores anything up to half of it
# mistake: 2.0**-7 :: 2**-7 is the gap (eps) next to 1.0: an update of a whole gap is not ignored; rounding to nearest ignores only up to half of it
# mistake: 2.0**-9 :: at exactly half the gap the tie goes to the even neighbour, 1.0: that update is ignored too
# mistake: 2.0**-11 :: that is fp16's half gap (10 stored mantissa bits); bf16 stores 7
bf16_ignored_update = max(2.0**-k for k in range(1, 40)
                          if (torch.tensor(1.0, dtype=torch.bfloat16) + 2.0**-k).item() == 1.0)

# %% min_loss_scale
# hint: "not zero" is not enough: below fp16's normal range the numbers are 2**-24 apart, so a small value is stored with a large relative error; scale, cast to fp16, unscale in fp32 and compare with 1e-9
# mistake: next(2**k for k in range(64) if (torch.tensor(1e-9) * 2**k).half().item() != 0) :: not zero, but far from 1e-9: at this scale fp16 stores the scaled value with a large error (divide what fp16 kept by S and compare)
# mistake: 2**16 :: that scale lifts it into fp16's normal range, but subnormals already hold it within 1% at a smaller scale
# mistake: next(2**k for k in range(64) if abs((torch.tensor(1e-9) * 2**k).half().float().item() / 2**k - 1e-9) <= 0.1e-9) :: within 10%; the question asks within 1%
min_loss_scale = next(2**k for k in range(64)
                      if abs((torch.tensor(1e-9) * 2**k).half().float().item() / 2**k - 1e-9) <= 0.01e-9)

# %% clip_before_unscale
# hint: before unscale_ the gradients are still multiplied by the scale, so clipping compares S·‖g‖ with max_norm
# exact: write it as a power of two, 2.0**-k
# mistake: 1 / 65504 :: 65,504 is fp16's largest value, not the scale 2**16
# mistake: 2.0**16 :: the scaled norm S·‖g‖ is compared with 1.0: solve for ‖g‖
# mistake: 1.0 :: that would hold after unscale_; before it the gradients carry the scale
clip_before_unscale = 1.0 / 2**16

# %% LossScaler
# build: yes
# hint: scale multiplies the loss; step unscales every gradient and skips the optimizer's step when one is inf or NaN; update halves the scale after a skipped step and doubles it after growth_interval clean ones, counting from the last change
import torch


class LossScaler:
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale_, self.growth, self.backoff, self.interval = init_scale, growth_factor, backoff_factor, growth_interval
        self.clean, self.found_inf = 0, False

    def scale(self, loss):
        return loss * self.scale_

    def step(self, optimizer):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        for g in grads:
            g.div_(self.scale_)
        self.found_inf = not all(torch.isfinite(g).all() for g in grads)
        if not self.found_inf:
            optimizer.step()

    def update(self):
        if self.found_inf:
            self.scale_, self.clean = self.scale_ * self.backoff, 0
        else:
            self.clean += 1
            if self.clean == self.interval:
                self.scale_, self.clean = self.scale_ * self.growth, 0

    def get_scale(self):
        return self.scale_
