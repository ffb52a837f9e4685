"""Chapter 12's reference solutions (course_lib.workbook.exercises runs each block in the notebook; see README.md)."""

# %% intensity_mul_add
# hint: count per element, as section 3 did for a*b + a: the FLOPs, and every 4-byte read or write of memory; here the added array is a third one, so ask again what each kernel reads, eager (two kernels, a temporary between them) and fused (one)
# printed: 0.001
# mistake: {"eager": 2 / (6 * 4), "fused": 2 / (3 * 4)} :: that is a*b + a: count again what the fused kernel reads now that the added array is not a
# mistake: {"eager": 2 / (4 * 4), "fused": 2 / (4 * 4)} :: eager runs two kernels: where does the temporary a*b live between them, and what does that cost?
# mistake: {"eager": 2 / 6, "fused": 2 / 4} :: bytes, not elements: 4 bytes an fp32 element
intensity_mul_add = {"eager": 2 / (6 * 4), "fused": 2 / (4 * 4)}

# %% io_wait_expected
# hint: draw one step on a time line with num_workers=0: nothing loads while the model computes, and nothing computes while a batch loads; measure both parts in step-times
# mistake: 1 / (1 + P.io_slowdown) :: that is the share spent computing; the question asks for the waiting
# mistake: P.io_slowdown :: a share of the step (waiting over waiting plus computing), not a ratio of times
io_wait_expected = P.io_slowdown / (1 + P.io_slowdown)

# %% mfu_7b_h100
# hint: MFU is the FLOPs the model needs per second (training FLOPs a token times tokens a second) over the GPU's peak; the H100 SXM's dense bf16 peak is in cl.timing.GPU_PEAK_BF16
# mistake: 6 * psi7_ * 3000 / cl.timing.GPU_PEAK_BF16["H100"] :: the attention scores add 12·L·h·s FLOPs a token to 6Ψ
# mistake: 2 * psi7_ * 3000 / cl.timing.GPU_PEAK_BF16["H100"] :: 2Ψ is the forward alone; training adds the backward's 4Ψ
# mistake: 100 * mfu_7b_h100 :: a fraction, not a percentage
# mistake: 8 * mfu_7b_h100 :: one GPU's 3,000 tokens/s over one GPU's peak (or all eight's tokens over all eight peaks: the same)
q7_ = cl.models.QWEN25["Qwen2.5-7B"]
psi7_ = cl.memory.count_params(q7_)
mfu_7b_h100 = cl.mfu(3000, cl.flops_per_token(psi7_, q7_["num_hidden_layers"], q7_["hidden_size"], 2048),
                     cl.timing.GPU_PEAK_BF16["H100"])
