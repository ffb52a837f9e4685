"""Chapter 09's reference solutions (course_lib.exercises runs each block in the notebook; see README.md)."""

# %% lora_r64_7b
# hint: lora_params (section 3) with Qwen2.5-7B's config (q7) and r = 64: every adapted matrix costs r·(d_in + d_out)
lora_r64_7b = lora_params(q7, 64)

# %% lora_qv_percent
# hint: 100 × lora_params(q7, 8, ["q_proj", "v_proj"]) / psi7
# rel: 1e-6
lora_qv_percent = 100 * lora_params(q7, 8, ["q_proj", "v_proj"]) / psi7

# %% lora_r4_optimizer_bytes
# hint: AdamW keeps 8 bytes (two fp32 moments) per trained parameter plus a 4-byte step counter per trained tensor; each adapted projection trains two tensors, A and B; count the parameters with lora_params(model.config.to_dict(), 4)
cfg_ = model.config.to_dict()
lora_r4_optimizer_bytes = 8 * lora_params(cfg_, 4) + 4 * 2 * len(TARGETS) * cfg_["num_hidden_layers"]
