"""Chapter 00's reference solutions (course_lib.exercises runs each block in the notebook; see README.md)."""

# %% zero_gpus_32b
# hint: loop over n = 1, 2, ... and keep the first n where cl.memory.zero_state_bytes(psi, stage, n)["total"] <= 80 * GB; Ψ from cl.memory.count_params(cl.models.QWEN25["Qwen2.5-32B"])
psi_32b_ = cl.memory.count_params(cl.models.QWEN25["Qwen2.5-32B"])
zero_gpus_32b = {f"zero{stage}": next(n for n in range(1, 4097)
                                      if cl.memory.zero_state_bytes(psi_32b_, stage, n)["total"] <= 80 * GB)
                 for stage in (2, 3)}

# %% activations_7b_4k
# hint: cl.memory.step_memory(q7, precision="bf16-mixed", seq=4096, micro_batch=1) holds the decoder layers' "activations" (the validated Qwen2 count, section 5), in bytes; divide by GB
# rel: 0.01
activations_7b_4k = cl.memory.step_memory(q7, precision="bf16-mixed", seq=4096, micro_batch=1)["activations"] / GB

# %% sgd_state_bytes
# hint: build cl.models.tiny_qwen2(**P.model, seed=P.seed), take one backward and one step of torch.optim.SGD(..., momentum=0.9), then cl.model_state_bytes(model, optimizer)["total"]: 4 (weights) + 4 (gradients) + 4 (momentum) bytes per parameter
m_ = cl.models.tiny_qwen2(**P.model, seed=P.seed)
opt_ = torch.optim.SGD(m_.parameters(), lr=0.1, momentum=0.9)
m_(**cl.models.random_batch(m_.config.vocab_size, 2, 16, seed=0)).loss.backward()
opt_.step()
sgd_state_bytes = cl.model_state_bytes(m_, opt_)["total"]
