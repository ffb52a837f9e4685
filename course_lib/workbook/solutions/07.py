"""Chapter 07's reference solutions (course_lib.workbook.exercises runs each block in the notebook; see README.md)."""

# %% fsdp2_7b_64_gib
# hint: section 5 counted, part by part, what one rank holds in fp32 and what divides it; scale that to Qwen2.5-7B's parameter count (cl.memory.count_params) and 64 ranks; mind the unit
# mistake: 16 * psi_7b_ / 64 / GB :: GiB: 2**30 bytes, not 1e9
# mistake: 16 * psi_7b_ / 2**30 :: FSDP2 shards weights, gradients and optimizer state over all 64 ranks
# mistake: (4 + 12 / 64) * psi_7b_ / 2**30 :: FSDP2 shards the weights too (like ZeRO-3), not only gradients and optimizer state
psi_7b_ = cl.memory.count_params(cl.models.QWEN25["Qwen2.5-7B"])
fsdp2_7b_64_gib = zero_state_bytes(psi_7b_, 3, 64, 4, 4, 8)["total"] / 2**30

# %% all_gathers_24
# hint: count in section 4's traces how often one step gathers each layer, and the root unit, under each setting; then scale the layers to 24
# mistake: {"default": 2 * 24, "keep": 24} :: the root unit (embedding, final norm, head) is gathered too, once
# mistake: {"default": 1 + 24, "keep": 1 + 24} :: by default a layer is freed after its forward and gathered again for its backward
all_gathers_24 = {"default": 1 + 2 * 24, "keep": 1 + 24}

# %% gathered_peak_bf16
# hint: section 4's check gathered_peak_default_bytes names what the default peak holds gathered (root_b and layer_b are its parts, in fp32 bytes); what does param_dtype change in it?
# mistake: root_b + layer_b :: param_dtype=bf16 gathers 2 bytes a parameter instead of 4
# mistake: (root_b + 2 * layer_b) // 2 :: the probe's peak counts the root and one layer swapped in; a prefetched layer waits in its gather buffer, not counted
gathered_peak_bf16 = (root_b + layer_b) // 2
