"""Chapter 00's reference solutions (course_lib.workbook.exercises runs each block in the notebook; see README.md)."""

# %% zero_gpus_32b
# hint: count Qwen2.5-32B's parameters from its config, then try n = 1, 2, ... GPUs per stage and keep the first n whose per-GPU model states fit in 80 GB (80e9 bytes)
# mistake: {f"zero{st}": next(n for n in range(1, 4097) if cl.memory.zero_state_bytes(psi_32b_, st, n)["total"] <= 80 * 2**30) for st in (2, 3)} :: the GPUs are 80 GB (decimal, 80e9 bytes), as the calculator counts; 80 GiB is 86e9 bytes
# mistake: {f"zero{st}": next(n for n in range(1, 4097) if cl.memory.zero_state_bytes(psi_32b_, st, n, k=8)["total"] <= 80 * GB) for st in (2, 3)} :: mixed-precision AdamW keeps 12 bytes of optimizer state a parameter: the fp32 master copy as well as the two moments
# mistake: {"zero2": math.ceil(16 * psi_32b_ / (80 * GB)), "zero3": math.ceil(16 * psi_32b_ / (80 * GB))} :: ZeRO-2 does not shard the bf16 weights: each GPU keeps all 2Ψ of them, whatever the number of GPUs
psi_32b_ = cl.memory.count_params(cl.models.QWEN25["Qwen2.5-32B"])
zero_gpus_32b = {f"zero{stage}": next(n for n in range(1, 4097)
                                      if cl.memory.zero_state_bytes(psi_32b_, stage, n)["total"] <= 80 * GB)
                 for stage in (2, 3)}

# %% activations_7b_4k
# hint: section 5's count covers the whole model; the head's share (final norm and logits) is the same whatever the number of layers, so a config with no layers isolates it. Count 16-bit values (bytes_per_value=2) and give decimal GB
# rel: 0.005
# mistake: 34 * 4096 * 1 * q7["hidden_size"] * q7["num_hidden_layers"] / GB :: 34·s·b·h is GPT's constant: chapter 00 shows a Qwen2 layer keeps much more (its SwiGLU MLP, its norms)
# mistake: 28 * cl.memory.layer_activation_bytes(q7, 4096, "bf16") / 2**30 :: decimal GB (1e9 bytes), not GiB
# mistake: 28 * cl.memory.layer_activation_bytes(q7, 4096, "fp32") / GB :: bf16: 2 bytes a value (the norms' upcast inputs aside), not fp32's 4
# mistake: cl.memory.qwen2_activation_bytes(q7, 4096, 1, bytes_per_value=2) / GB :: that count includes the head (final norm and logits): the question asks for the decoder layers only
activations_7b_4k = q7["num_hidden_layers"] * cl.memory.layer_activation_bytes(q7, 4096, "bf16") / GB

# %% sgd_state_bytes
# hint: count what one step leaves behind, per parameter of the fp32 model: weights, gradients, and what SGD with momentum keeps (no step counter, unlike AdamW)
# mistake: 16 * sum(p.numel() for p in m_.parameters()) + 4 * len(list(m_.parameters())) :: that is AdamW's state (two moments and a step counter); SGD with momentum keeps one buffer a parameter
# mistake: 8 * sum(p.numel() for p in m_.parameters()) :: the momentum buffer is state too: 4 more bytes a parameter
m_ = cl.models.tiny_qwen2(**P.model, seed=P.seed)
opt_ = torch.optim.SGD(m_.parameters(), lr=0.1, momentum=0.9)
m_(**cl.models.random_batch(m_.config.vocab_size, 2, 16, seed=0)).loss.backward()
opt_.step()
sgd_state_bytes = cl.model_state_bytes(m_, opt_)["total"]
