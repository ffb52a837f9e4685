"""cl.losses.chunked_cross_entropy: the full loss and its gradients without the full logits."""
import pytest
import torch
import torch.nn.functional as F

import course_lib as cl
from course_lib.memory.losses import IGNORE_INDEX, chunked_cross_entropy


def _inputs(tokens=37, hidden=16, vocab=101, batch=None, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shape = (tokens,) if batch is None else (batch, tokens)
    h = torch.randn(*shape, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, shape, generator=g)
    y.view(-1)[::3] = IGNORE_INDEX
    return h, w, y


def _grads(loss_fn, h, w):
    h.grad = w.grad = None
    loss = loss_fn()
    loss.backward()
    return loss.detach(), h.grad.clone(), w.grad.clone()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_equals_full_cross_entropy_and_gradients(chunk, reduction):
    h, w, y = _inputs()
    full = _grads(lambda: F.cross_entropy(h @ w.T, y, ignore_index=IGNORE_INDEX, reduction=reduction), h, w)
    ours = _grads(lambda: chunked_cross_entropy(h, w, y, chunk=chunk, reduction=reduction), h, w)
    for a, b in zip(ours, full):
        assert _rel(a, b) <= 1e-5


def test_shift_matches_the_models_own_loss():
    model = cl.models.tiny_qwen2(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=64, vocab_size=97)
    batch = cl.models.random_batch(97, 3, 12)
    batch["labels"][:, :4] = IGNORE_INDEX                      # an SFT prompt
    expected = model(**batch).loss
    hidden = model.model(input_ids=batch["input_ids"]).last_hidden_state
    ours = chunked_cross_entropy(hidden, model.lm_head.weight, batch["labels"], chunk=7, shift=True)
    assert abs(ours.item() - expected.item()) <= 1e-5 * expected.item()
    ours.backward()
    mine = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(**batch).loss.backward()
    for a, p in zip(mine, model.parameters()):
        assert _rel(a, p.grad) <= 1e-5


def test_incoming_gradient_scales_both_gradients():
    h, w, y = _inputs()
    loss = chunked_cross_entropy(h, w, y, chunk=8)
    (3.0 * loss).backward()
    h2, w2, _ = _inputs()
    (3.0 * F.cross_entropy(h2 @ w2.T, y, ignore_index=IGNORE_INDEX)).backward()
    assert _rel(h.grad, h2.grad) <= 1e-5 and _rel(w.grad, w2.grad) <= 1e-5


def test_bf16_inputs_give_bf16_gradients_close_to_fp32():
    h, w, y = _inputs(dtype=torch.bfloat16)
    loss = chunked_cross_entropy(h, w, y, chunk=8)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.bfloat16
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    F.cross_entropy(h32 @ w32.T, y, ignore_index=IGNORE_INDEX).backward()
    assert _rel(w.grad.float(), w32.grad) < 0.02


def test_no_trained_label_gives_zero_loss_and_zero_gradients():
    h, w, y = _inputs()
    y[:] = IGNORE_INDEX
    loss = chunked_cross_entropy(h, w, y, chunk=8)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_no_grad_and_frozen_weight():
    h, w, y = _inputs()
    with torch.no_grad():
        assert abs(chunked_cross_entropy(h, w, y).item() - F.cross_entropy(h @ w.T, y).item()) < 1e-5
    w.requires_grad_(False)
    chunked_cross_entropy(h, w, y, chunk=4).backward()
    assert h.grad is not None and w.grad is None


def test_second_backward_says_why():
    h, w, y = _inputs()
    loss = chunked_cross_entropy(h, w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("call, message", [
    (lambda h, w, y: chunked_cross_entropy(h, w, y, chunk=0), "chunk must be"),
    (lambda h, w, y: chunked_cross_entropy(h, w, y, reduction="none"), "reduction"),
    (lambda h, w, y: chunked_cross_entropy(h, w, y[:-1]), "do not match"),
    (lambda h, w, y: chunked_cross_entropy(h, w.T, y), "should be"),
])
def test_bad_input_is_one_clear_error(call, message):
    h, w, y = _inputs()
    with pytest.raises(ValueError, match=message):
        call(h, w, y)


def test_peak_is_one_chunk_not_the_full_logits():
    """Measured with the tracker: the plain loss holds three (tokens × V) fp32 tensors at its peak, the
    chunked one the weight's gradient, the hidden states' gradient and two (chunk × V) tensors."""
    tokens, hidden, vocab, chunk = 256, 16, 8192, 32
    h, w, y = _inputs(tokens, hidden, vocab)
    y[:] = torch.randint(0, vocab, (tokens,))
    peaks = {}
    for name, fn in {"full": lambda: F.cross_entropy(h @ w.T, y),
                     "chunked": lambda: chunked_cross_entropy(h, w, y, chunk=chunk)}.items():
        h.grad = w.grad = None
        with cl.LiveTensorBytes(extra={"inputs": [h, w]}) as mem:
            fn().backward()
        peaks[name] = mem.peak - mem.timeline()["total"][0]
    assert peaks["full"] == pytest.approx(3 * tokens * vocab * 4, rel=0.02)
    assert peaks["chunked"] == pytest.approx(vocab * hidden * 4 + tokens * hidden * 4 + 2 * chunk * vocab * 4, rel=0.02)
