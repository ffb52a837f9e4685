"""Chapter 04's reference solutions (course_lib.workbook.exercises runs each block in the notebook; see README.md)."""

# %% lr_at_7000
# hint: step 7000 is past the warmup: find how far it is through the cosine (which starts when the warmup ends), then scale the cosine's value into [floor, peak]
# mistake: 2e-5 * 0.5 * (1 + math.cos(math.pi * 6000 / 9000)) :: the cosine ends on the floor (2e-6), not on 0: scale it into [floor, peak]
# mistake: cl.train.lr_factor(7000, 1000, 10000, 2e-6 / 2e-5) :: that is the factor: multiply by the peak learning rate
# mistake: 2e-5 - (2e-5 - 2e-6) * 6000 / 9000 :: the decay is a cosine, not a straight line
# mistake: 2e-6 + (2e-5 - 2e-6) * 0.5 * (1 + math.cos(math.pi * 7000 / 10000)) :: the cosine starts when the warmup ends: at step 7000 it is 6000 of its 9000 steps in
lr_at_7000 = 2e-5 * cl.train.lr_factor(7000, 1000, 10000, 2e-6 / 2e-5)

# %% accum_steps_64
# hint: the tokens of one optimizer step are micro-batch × accumulation steps × GPUs × sequence length: keep that product
# mistake: 16 :: the same accumulation on 8x the GPUs makes every optimizer step 8x larger (and changes what the learning rate was tuned for)
# mistake: 16 * 8 :: more GPUs already add sequences to each step: accumulate fewer micro-batches, not more
accum_steps_64 = effective_batch(4, 16, 8) // effective_batch(4, 1, 64)

# %% token_weights
# hint: `counts` holds the target tokens of each micro-batch of `masked`; the step's loss should be the mean over all of the step's target tokens: what weight turns a micro-batch's mean back into its part of that mean?
# mistake: [1 / len(counts)] * len(counts) :: equal weights are right only when every micro-batch has as many target tokens: here they differ
# mistake: list(counts) :: weights, i.e. shares of all target tokens: they add up to 1
token_weights = [c / sum(counts) for c in counts]
