"""Chapter 03's reference solutions (course_lib.exercises runs each block in the notebook; see README.md)."""

# %% k_star_7b
# hint: k* = √(n·x/a): n = 28 layers; a = cl.memory.activation_bytes_per_layer(s, b, h, heads, recompute="selective"); x = 2·s·b·h bytes (one bf16 layer input); s and b cancel
# rel: 0.001
q7_ = cl.models.QWEN25["Qwen2.5-7B"]
s_, b_, h_ = 2048, 1, q7_["hidden_size"]
a_ = cl.memory.activation_bytes_per_layer(s_, b_, h_, q7_["num_attention_heads"], recompute="selective")
k_star_7b = (q7_["num_hidden_layers"] * 2 * s_ * b_ * h_ / a_) ** 0.5

# %% sqrt_n_chain
# hint: peak(k) = n/k + k in units of x; try every k that divides n = 100 and keep the smallest peak
ks_ = [k for k in range(1, 101) if 100 % k == 0]
k_ = min(ks_, key=lambda k: 100 / k + k)
sqrt_n_chain = {"k": k_, "peak": 100 / k_ + k_}

# %% ckpt_saved_bytes
# hint: x = torch.randn(2, 32, model.config.hidden_size, device=device, requires_grad=True); with cl.SavedTensors(mlp) as s: checkpoint(mlp, x, use_reentrant=False); then s.bytes: only the input stays
x_ = torch.randn(2, 32, model.config.hidden_size, device=device, requires_grad=True)
with cl.SavedTensors(mlp) as s_:
    checkpoint(mlp, x_, use_reentrant=False)
ckpt_saved_bytes = s_.bytes
