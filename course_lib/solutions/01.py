"""Chapter 01's reference solutions (course_lib.exercises runs each block in the notebook; see README.md)."""

# %% bf16_ignored_update
# hint: try u = 2**-k for k = 1, 2, ... and keep the largest u for which torch.tensor(1.0, dtype=torch.bfloat16) + u == 1.0: rounding to nearest ignores anything up to half the gap (eps = 2**-7) next to 1.0
bf16_ignored_update = max(2.0**-k for k in range(1, 40)
                          if (torch.tensor(1.0, dtype=torch.bfloat16) + 2.0**-k).item() == 1.0)

# %% min_loss_scale
# hint: loop over S = 2**k and keep the first S for which (torch.tensor(1e-9) * S).half() is not 0 (values from half the smallest fp16 subnormal up round to it)
min_loss_scale = next(2**k for k in range(64) if (torch.tensor(1e-9) * 2**k).half().item() != 0)

# %% clip_before_unscale
# hint: before unscale_ the gradients are S = 2**16 times too large, so clip_grad_norm_(max_norm=1.0) cuts in when S·‖g‖ > 1, i.e. at ‖g‖ = 1/S
# rel: 0.001
clip_before_unscale = 1.0 / 2**16
