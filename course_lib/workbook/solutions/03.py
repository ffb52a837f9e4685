"""Chapter 03's reference solutions (course_lib.workbook.exercises runs each block in the notebook; see README.md)."""

# %% k_star_7b
# hint: s and b cancel: compare one layer's bf16 input (h values a token, 2 bytes each) with what one Qwen2 layer keeps a token (chapter 00's validated count, cl.memory.layer_activation_bytes), then take √(n·x/a) with n = 28
# mistake: (28 * 2 / 34) ** 0.5 :: 34·s·b·h is GPT's constant: chapter 00 shows a Qwen2 layer keeps about 1.9x that
# mistake: (28 * 4 * q7_["hidden_size"] / a_) ** 0.5 :: the layer input is bf16 here: 2 bytes a value, not 4
# mistake: 28 ** 0.5 :: √n assumes a layer keeps no more than its input (a ≈ x); a Qwen2 layer keeps far more
q7_ = cl.models.QWEN25["Qwen2.5-7B"]
a_ = cl.memory.layer_activation_bytes(q7_, 1, "bf16")
k_star_7b = (q7_["num_hidden_layers"] * 2 * q7_["hidden_size"] / a_) ** 0.5

# %% segment_7b
# hint: peak(k) = n/k·x + k·a, with n = 28 and a/x from the exercise before; try each k that divides 28 and keep the k with the smallest peak
# mistake: 4 :: √28 ≈ 5.3 is the √n rule's answer, which assumes a ≈ x; with a ≫ x the recomputed segment costs more than the checkpoints it saves
# mistake: 7 :: √28 ≈ 5.3 is the √n rule's answer, which assumes a ≈ x; with a ≫ x the recomputed segment costs more than the checkpoints it saves
# mistake: 28 :: one segment of all 28 layers recomputes everything at once: its k·a is the largest peak of all
q7_ = cl.models.QWEN25["Qwen2.5-7B"]
ratio_ = cl.memory.layer_activation_bytes(q7_, 1, "bf16") / (2 * q7_["hidden_size"])
segment_7b = min((k for k in range(1, 29) if 28 % k == 0), key=lambda k: 28 / k + k * ratio_)

# %% reentrant_grads
# hint: section 1 explains the two implementations: which of them produces weight gradients when no input requires grad? Try it: run the checkpointed MLP on such an input each way, backpropagate where you can, and count the MLP's parameters whose .grad is set
# mistake: {"reentrant": 3, "non_reentrant": 3} :: the reentrant checkpoint runs the block under no_grad and re-enters autograd only through inputs that require grad: the weights do not count
# mistake: {"reentrant": 0, "non_reentrant": 0} :: the non-reentrant checkpoint records the graph as usual: the weights get gradients whatever the input
# mistake: {"reentrant": 0, "non_reentrant": 1} :: count the MLP's parameters (gate, up and down projections), not its blocks
import warnings as warnings_
x_ = torch.randn(2, 32, model.config.hidden_size, device=device)  # no requires_grad: as after a frozen embedding
reentrant_grads = {}
for kind_, flag_ in (("reentrant", True), ("non_reentrant", False)):
    mlp.zero_grad(set_to_none=True)
    with warnings_.catch_warnings():
        warnings_.simplefilter("ignore")  # the reentrant one warns that no input requires grad
        out_ = checkpoint(mlp, x_, use_reentrant=flag_)
    if out_.requires_grad:
        out_.sum().backward()
    reentrant_grads[kind_] = sum(p.grad is not None for p in mlp.parameters())
mlp.zero_grad(set_to_none=True)

# %% checkpointed
# build: yes
# hint: a torch.autograd.Function whose forward saves only the input; its backward runs the block again, and there gradients are off until you turn them on
import torch


class Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, x):
        ctx.block = block
        ctx.save_for_backward(x)
        return block(x)

    @staticmethod
    def backward(ctx, grad_out):
        x = ctx.saved_tensors[0]
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.block(x)
        torch.autograd.backward(out, grad_out)
        return None, x.grad


def checkpointed(block, x):
    return Checkpoint.apply(block, x)
