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
# hint: build two rows, a reference and one with 60% of its memory, each with its step times as "time" (seconds: 9.7e-6 for 9.7 µs), and ask capstone.ranking for the row's "kind"
# alias: no slowdown measured = no slowdown | no measured slowdown
# mistake: "trade" :: its median is higher, but its range (9.7–10.6) overlaps the reference's (9.5–10.2): the verdict is indistinguishable, not slower
# mistake: "speed only" :: it needs 40% less memory: that is the row's gain; what does a time the spreads cannot separate count as?
ranking_kind = capstone.ranking({"ref": {"ref": None, "device": 100, "time": [9.5e-6, 9.8e-6, 9.9e-6, 10.0e-6, 10.2e-6]},
                                 "x": {"ref": "ref", "device": 60, "time": [9.7e-6, 10.1e-6, 10.4e-6, 10.6e-6, 9.9e-6]}}
                                )[0]["kind"]
