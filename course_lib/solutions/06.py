"""Chapter 06's reference solutions (course_lib.exercises runs each block in the notebook; see README.md)."""

# %% zero3_14b_gib
# hint: cl.memory.zero_state_bytes(Ψ, 3, 16)["total"] with Ψ = cl.memory.count_params(cl.models.QWEN25["Qwen2.5-14B"]); GiB: divide by 2**30 (not by 1e9)
# rel: 0.001
zero3_14b_gib = cl.memory.zero_state_bytes(cl.memory.count_params(cl.models.QWEN25["Qwen2.5-14B"]), 3, 16)["total"] / 2**30

# %% zero2_offload_7b_gib
# hint: with offload_optimizer the GPU keeps the bf16 weights whole (2Ψ) and its bf16 gradient slice (2Ψ/N); the fp32 master, the moments and the fp32 gradient slice go to the host
# rel: 0.001
psi_7b_ = cl.memory.count_params(cl.models.QWEN25["Qwen2.5-7B"])
zero2_offload_7b_gib = (2 * psi_7b_ + 2 * psi_7b_ / 8) / 2**30

# %% persistence_share
# hint: share_kept_whole (section 2) with Qwen2.5-0.5B's config and the threshold
persistence_share = share_kept_whole(cl.models.QWEN25["Qwen2.5-0.5B"], 1e5)
