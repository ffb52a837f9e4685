"""Chapter 10's reference solutions (course_lib.exercises runs each block in the notebook; see README.md)."""

# %% plan_7b_zero3_16
# hint: plan_for(model, zero_stage=..., ranks=..., seq=2048, batch=1, checkpointing=True)["peak"] / GB
# rel: 0.001
plan_7b_zero3_16 = plan_for("Qwen2.5-7B", zero_stage=3, ranks=16, seq=2048, batch=1, checkpointing=True)["peak"] / GB

# %% lora_r64_32b_gpu
# hint: lora_plan(model, r=64)["peak"] is the step's high-water mark in bytes; divide by GB and ask fits()
lora_r64_32b_gpu = fits(lora_plan("Qwen2.5-32B", r=64)["peak"] / GB)

# %% answer_tokens
# hint: D.assistant_mask(tokenizer, messages) returns (ids, mask); the loss sees the positions where mask is 1
answer_tokens = sum(D.assistant_mask(tokenizer, held_out[1]["messages"])[1])
