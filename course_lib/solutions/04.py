"""Chapter 04's reference solutions (course_lib.exercises runs each block in the notebook; see README.md)."""

# %% lr_at_5500
# hint: the peak times cl.train.lr_factor(step, warmup_steps, total_steps, floor / peak)
# rel: 1e-6
lr_at_5500 = 2e-5 * cl.train.lr_factor(5500, 1000, 10000, 2e-6 / 2e-5)

# %% tokens_per_step
# hint: effective batch (in sequences) = micro-batch × accumulation steps × GPUs; then times the sequence length
tokens_per_step = effective_batch(4, 8, 64) * 2048

# %% token_weights
# hint: `counts` holds the target tokens of each micro-batch of `masked`; each micro-batch's mean loss is weighted by its share of all target tokens
token_weights = [c / sum(counts) for c in counts]
