"""Chapter 08's reference solutions (course_lib.exercises runs each block in the notebook; see README.md)."""

# %% bubble_p4_m16
# hint: ppl.bubble_fraction(p, m) = (p - 1) / (m + p - 1)
bubble_p4_m16 = ppl.bubble_fraction(4, 16)

# %% min_micro_batches
# hint: try m = 1, 2, ... and keep the first with ppl.bubble_fraction(8, m) < 0.05
min_micro_batches = next(m for m in range(1, 100_000) if ppl.bubble_fraction(8, m) < 0.05)

# %% tp_degrees_14b
# hint: tensor parallelism cuts attention by whole heads: t must divide both num_attention_heads and num_key_value_heads (cl.models.QWEN25["Qwen2.5-14B"])
q14_ = cl.models.QWEN25["Qwen2.5-14B"]
tp_degrees_14b = [t_ for t_ in range(1, 65) if q14_["num_attention_heads"] % t_ == 0 and q14_["num_key_value_heads"] % t_ == 0]
