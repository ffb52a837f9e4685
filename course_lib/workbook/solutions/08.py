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
