"""Chapter 02's reference solutions (course_lib.exercises runs each block in the notebook; see README.md)."""

# %% fp16_logit_scale
# hint: loop over 2**k and keep the largest k for which np.float16(8.0 * 2**k) is still finite (fp16's largest value is 65,504); wrap it in np.errstate(over="ignore")
with np.errstate(over="ignore"):
    fp16_logit_scale = max(2**k for k in range(40) if np.isfinite(np.float16(8.0 * 2**k)))

# %% scale_after_overflows
# hint: every overflowing step halves the scale; every P.growth_steps clean steps in a row double it
scale_after_overflows = 2.0**15 / 2**3 * 2**2

# %% no_loss_scale_policies
# hint: `wrapped` (section 2) says, per policy, whether compile() put a LossScaleOptimizer around the optimizer
no_loss_scale_policies = sorted(p for p, w in wrapped.items() if not w)
