"""Chapter 02's reference solutions (course_lib.workbook.exercises runs each block in the notebook; see README.md)."""

# %% fp16_logit_scale
# hint: 8·s must stay at or below fp16's largest value, 65,504 (past it np.float16 gives inf); the answer is s itself, a power of two, not its exponent
# mistake: 12 :: the question asks for s itself, a power of two, not its exponent k
# mistake: 8192 :: 8 × 8192 = 65,536 is above fp16's largest value, 65,504: it overflows to inf
# mistake: 65504 / 8 :: s must be a power of two
with np.errstate(over="ignore"):
    fp16_logit_scale = max(2**k for k in range(40) if np.isfinite(np.float16(8.0 * 2**k)))

# %% scale_after_overflows
# hint: every overflowing step halves the scale; every P.growth_steps clean steps in a row double it
# mistake: 2.0**15 / 2**3 :: the clean steps afterwards grow it again: one doubling per P.growth_steps clean steps in a row
# mistake: 2.0**15 * 2**2 :: the overflowing steps come first and each halves the scale
# mistake: 2.0**15 / 2**3 * 2 :: 2 × P.growth_steps clean steps are two full growth intervals: two doublings
scale_after_overflows = 2.0**15 / 2**3 * 2**2

# %% no_loss_scale_policies
# hint: section 2 recorded, per policy, whether compile() wrapped the optimizer; which policies need no loss scaling, and why (think of the exponent range)?
# mistake: sorted(p for p, w in wrapped.items() if w) :: those are the policies that DID get a LossScaleOptimizer
# mistake: sorted(p for p, w in wrapped.items() if not w and "16" not in p) :: bf16 keeps fp32's exponent range: mixed_bfloat16 needs no loss scaling either
no_loss_scale_policies = sorted(p for p, w in wrapped.items() if not w)
