"""Chapter 07's reference solutions (course_lib.exercises runs each block in the notebook; see README.md)."""

# %% fsdp2_7b_64_gib
# hint: zero_state_bytes(Ψ, stage=3, ranks=64, params=4, grads=4, k=8) with Ψ = cl.memory.count_params(cl.models.QWEN25["Qwen2.5-7B"]); GiB = bytes / 2**30
# rel: 0.001
fsdp2_7b_64_gib = zero_state_bytes(cl.memory.count_params(cl.models.QWEN25["Qwen2.5-7B"]), 3, 64, 4, 4, 8)["total"] / 2**30

# %% all_gathers_24
# hint: the root is gathered once; with the default every layer is gathered in forward and again in backward, with reshard_after_forward=False only once
all_gathers_24 = {"default": 1 + 2 * 24, "keep": 1 + 24}

# %% gathered_peak_bf16
# hint: section 4's default peak is root_b + layer_b bytes of fp32 parameters; param_dtype=bf16 gathers 2 bytes per parameter instead of 4
gathered_peak_bf16 = (root_b + layer_b) // 2
