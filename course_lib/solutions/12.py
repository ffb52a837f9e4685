"""Chapter 12's reference solutions (course_lib.exercises runs each block in the notebook; see README.md)."""

# %% intensity_mul_add
# hint: FLOPs per element over bytes moved per element (fp32: 4 B per read or write); eager runs a*b (reads 2, writes a temporary) then + a (reads the temporary and a, writes the result); fused reads a and b once and writes once
intensity_mul_add = {"eager": 2 / (6 * 4), "fused": 2 / (3 * 4)}

# %% io_wait_expected
# hint: with num_workers=0 each step first waits for its batch (io_slowdown step-times), then computes (one step-time)
io_wait_expected = P.io_slowdown / (1 + P.io_slowdown)

# %% mfu_7b_h100
# hint: cl.mfu(tokens_per_s, cl.flops_per_token(Ψ, layers, hidden, seq), peak) with Ψ = cl.memory.count_params(q7), seq 2048 and the H100's bf16 peak, cl.timing.GPU_PEAK_BF16["H100"]
# rel: 0.001
q7_ = cl.models.QWEN25["Qwen2.5-7B"]
mfu_7b_h100 = cl.mfu(3000, cl.flops_per_token(cl.memory.count_params(q7_), q7_["num_hidden_layers"], q7_["hidden_size"], 2048),
                     cl.timing.GPU_PEAK_BF16["H100"])
