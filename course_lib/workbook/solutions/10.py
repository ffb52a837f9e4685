"""Chapter 10's reference solutions (course_lib.workbook.exercises runs each block in the notebook; see README.md)."""

# %% plan_7b_zero3_16
# hint: section 7's table comes from one memory model (plan_for); ask it for Qwen2.5-7B with the stage, ranks and checkpointing of the question, at s = 2048, b = 1, and read its peak in decimal GB
# mistake: plan_for("Qwen2.5-7B", zero_stage=3, ranks=16, seq=2048, batch=1, checkpointing=True)["peak"] / 2**30 :: decimal GB (1e9 bytes), as the table prints, not GiB
# mistake: plan_for("Qwen2.5-7B", zero_stage=3, ranks=16, seq=2048, batch=1, checkpointing=False)["peak"] / GB :: with checkpointing, as the question says
# mistake: plan_for("Qwen2.5-7B", zero_stage=3, ranks=16, seq=2048, batch=1, checkpointing=True)["total"] / GB :: the peak, not the sum of the parts: the step's high-water mark includes its temporaries
plan_7b_zero3_16 = plan_for("Qwen2.5-7B", zero_stage=3, ranks=16, seq=2048, batch=1, checkpointing=True)["peak"] / GB

# %% lora_r64_32b_gpu
# hint: section 7's lora_plan gives the step's peak in bytes for a model and a rank; the table's rule (fits) turns GB into the smallest GPU of the list
# alias: 24 GB (RTX 4090) = RTX 4090 | 4090 | 24 GB | 24
# alias: 40 GB (A100-40G) = A100-40G | A100 40GB | A100-40GB | 40 GB | 40
# alias: 80 GB (A100/H100) = A100/H100 | H100 | A100-80G | A100 80GB | H100 80GB | 80 GB | 80
# alias: 141 GB (H200) = H200 | 141 GB | 141
# mistake: next((g for g, cap in GPUS.items() if lora_plan("Qwen2.5-32B", r=64)["peak"] / GB <= cap), "does not fit") :: the table keeps 10% of each GPU for the runtime (CUDA context, allocator cache): the peak must fit in 90% of it
lora_r64_32b_gpu = fits(lora_plan("Qwen2.5-32B", r=64)["peak"] / GB)

# %% answer_tokens
# hint: D.assistant_mask(tokenizer, messages) returns the conversation's token ids and a mask; the loss sees the positions where the mask is 1
# mistake: len(D.assistant_mask(tokenizer, held_out[1]["messages"])[0]) :: the loss is taken on the assistant's tokens only, not on the whole conversation
answer_tokens = sum(D.assistant_mask(tokenizer, held_out[1]["messages"])[1])

# %% assistant_mask
# build: yes
# hint: render the conversation as text, find where each assistant header `<|im_start|>assistant\n` ends and where the `<|im_end|>` after it ends, then map those character spans to tokens with the tokenizer's offsets (return_offsets_mapping=True)
def assistant_mask(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    header, end = "<|im_start|>assistant\n", "<|im_end|>"
    spans, at = [], 0
    while (start := text.find(header, at)) >= 0:
        start += len(header)
        stop = text.find(end, start) + len(end)
        spans.append((start, stop))
        at = stop
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask
