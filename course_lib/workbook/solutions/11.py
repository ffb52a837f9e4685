"""Chapter 11's reference solutions (course_lib.workbook.exercises runs each block in the notebook; see README.md)."""

# %% zero3_7b_gib
# hint: section 6's ZeRO-3 check counts a rank's bytes per parameter: which model states are 16-bit in DeepSpeed's bf16 mode, which stay fp32, and what ZeRO-3 divides by N; count Qwen2.5-7B's parameters from its config; GiB are 2**30 bytes
# mistake: (2 * 2 + 12) * psi_7b_ / 8 / GB :: GiB: 2**30 bytes, not 1e9
# mistake: (2 * 4 + 12) * psi_7b_ / 8 / 2**30 :: bf16: b = 2 bytes a weight and a gradient, not 4
# mistake: (2 * 2 + 12) * psi_7b_ / 2**30 :: ZeRO-3 divides every model state by the N = 8 ranks
psi_7b_ = cl.memory.count_params(cl.models.QWEN25["Qwen2.5-7B"])
zero3_7b_gib = (2 * 2 + 12) * psi_7b_ / 8 / 2**30

# %% ckpt_speed_cost
# hint: a cost as a fraction of what base ran at: of base's tokens per second, which share did the ckpt row lose? (negative if it came out faster)
# printed: 0.01
# mistake: 100 * (1 - rows["ckpt"]["tokens_per_s"] / rows[base]["tokens_per_s"]) :: a fraction, not a percentage
ckpt_speed_cost = 1 - rows["ckpt"]["tokens_per_s"] / rows[base]["tokens_per_s"]

# %% ranking_kind
# hint: build two rows, a reference and one that needs 60% of its memory at 97% of its speed, and ask capstone.ranking with a 0.05 tolerance for the row's "kind"
# alias: no slowdown measured = no slowdown | free | no measured slowdown
# mistake: "trade" :: the row is 3% slower, inside the 5% tolerance: ranking does not count that as a slowdown
# mistake: "speed only" :: it needs 40% less memory: that is the row's gain; what does a 3% slowdown count as, with a 5% tolerance?
ranking_kind = capstone.ranking({"base": {"ref": None, "device": 100, "tokens_per_s": 100},
                                 "x": {"ref": "base", "device": 60, "tokens_per_s": 97}}, 0.05)[0]["kind"]
