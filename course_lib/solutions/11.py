"""Chapter 11's reference solutions (course_lib.exercises runs each block in the notebook; see README.md)."""

# %% zero3_7b_gib
# hint: (2b + 12)Ψ/N bytes per rank with b = 2 (bf16), N = 8, Ψ = cl.memory.count_params(cl.models.QWEN25["Qwen2.5-7B"]); GiB = bytes / 2**30
# rel: 0.001
zero3_7b_gib = (2 * 2 + 12) * cl.memory.count_params(cl.models.QWEN25["Qwen2.5-7B"]) / 8 / 2**30

# %% ckpt_speed_cost
# hint: 1 - rows["ckpt"]["tokens_per_s"] / rows[base]["tokens_per_s"] (negative if it came out faster)
# rel: 1e-6
ckpt_speed_cost = 1 - rows["ckpt"]["tokens_per_s"] / rows[base]["tokens_per_s"]

# %% ranking_kind
# hint: build rows = {"base": {"ref": None, "device": 100, "tokens_per_s": 100}, "x": {"ref": "base", "device": 60, "tokens_per_s": 97}} and read capstone.ranking(rows, 0.05)[0]["kind"]
ranking_kind = capstone.ranking({"base": {"ref": None, "device": 100, "tokens_per_s": 100},
                                 "x": {"ref": "base", "device": 60, "tokens_per_s": 97}}, 0.05)[0]["kind"]
