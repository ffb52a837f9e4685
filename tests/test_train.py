"""Unit tests of course_lib.sft.train (chapter 04's training-loop pieces)."""
import math

import pytest
import torch

import course_lib as cl
from course_lib.sft.train import (Monitor, accumulate, count_targets, global_grad_norm, lr_factor, split_batch,
                                  train_step, warmup_cosine)


def _schedule_lrs(warmup, total, floor, base=2e-5, extra=5):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = warmup_cosine(opt, warmup, total, floor)
    lrs = []
    for _ in range(total + extra + 1):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_schedule_hits_its_endpoints():
    base, warmup, total, floor = 2e-5, 10, 100, 0.1
    lrs = _schedule_lrs(warmup, total, floor, base)
    assert lrs[0] == 0.0
    assert lrs[warmup] == pytest.approx(base, rel=1e-12)
    assert lrs[warmup // 2] == pytest.approx(base / 2, rel=1e-12)
    assert lrs[total] == pytest.approx(floor * base, rel=1e-12)
    assert all(lr == pytest.approx(floor * base) for lr in lrs[total:])           # flat on the floor after
    mid = warmup + (total - warmup) // 2
    assert lrs[mid] == pytest.approx(base * (floor + (1 - floor) / 2), rel=1e-12)  # halfway down the cosine
    assert all(a <= b for a, b in zip(lrs[:warmup], lrs[1:warmup + 1]))          # rises, then only falls
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))


def test_schedule_edge_cases_and_bad_input():
    assert lr_factor(0, 0, 10, 0.0) == 1.0
    assert lr_factor(10, 0, 10, 0.0) == pytest.approx(0.0, abs=1e-15)
    assert lr_factor(5, 5, 5, 0.2) == pytest.approx(0.2)
    for args in [(20, 10, 0.1), (-1, 10, 0.1), (2, 10, 1.5)]:
        with pytest.raises(ValueError) as err:
            warmup_cosine(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), *args)
        assert "\n" not in str(err.value)


def test_global_grad_norm_is_what_clipping_measures():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model(torch.randn(4, 8)).pow(2).sum().backward()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    norm = global_grad_norm(model.parameters())
    assert norm == pytest.approx(float(flat.norm()), rel=1e-6)
    clipped = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=norm / 10))
    assert clipped == pytest.approx(norm, rel=1e-6)                        # returns the norm before clipping
    assert global_grad_norm(model.parameters()) == pytest.approx(norm / 10, rel=1e-4)
    assert global_grad_norm([torch.nn.Parameter(torch.zeros(2))]) == 0.0


def _tiny():
    return cl.models.tiny_qwen2(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                intermediate_size=64, vocab_size=64)


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_accumulation_equals_full_batch_even_with_masked_labels():
    model = _tiny()
    batch = cl.models.random_batch(64, 8, 16, seed=1)
    batch["labels"][:3, :11] = -100                        # uneven target counts per micro-batch
    model(**batch).loss.backward()
    full = _grads(model)
    model.zero_grad()
    micro = split_batch(batch, 4)
    assert sum(count_targets(mb) for mb in micro) == count_targets(batch)
    loss = accumulate(model, micro, weight="tokens")
    assert (full - _grads(model)).abs().max() <= 1e-6
    with torch.no_grad():
        assert loss == pytest.approx(float(model(**batch).loss), rel=1e-5)
    model.zero_grad()
    accumulate(model, micro, weight="mean")                 # 1/k weighting is wrong when counts differ
    assert (full - _grads(model)).abs().max() > 1e-4
    with pytest.raises(ValueError):
        split_batch(batch, 3)


def test_train_step_reports_and_clips(tmp_path):
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = warmup_cosine(opt, 2, 6, 0.1)
    monitor = Monitor("test", log_dir=tmp_path)
    for step in range(6):
        stats = train_step(model, opt, split_batch(cl.models.random_batch(64, 4, 16, seed=step), 2),
                           scheduler=sched, max_grad_norm=1e-3)
        monitor.log(step, **stats)
        assert all(p.grad is None for p in model.parameters())
    steps, lrs = monitor.series("lr")
    assert steps == list(range(6)) and lrs[0] == 0.0 and lrs[2] == pytest.approx(1e-3)
    assert set(monitor.history) == {"loss", "grad_norm", "lr"}
    monitor.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    Monitor("test", log_dir=tmp_path).close()                         # a new run replaces the old events
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    fig = monitor.plot()
    assert len([ax for ax in fig.axes if ax.has_data()]) == 3
    with pytest.raises(KeyError):
        monitor.series("nope")
    assert math.isfinite(stats["loss"])


def test_train_step_with_a_grad_scaler_reports_the_loss_scale():
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    scales = []
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            stats = train_step(model, opt, split_batch(cl.models.random_batch(64, 4, 16, seed=step), 2), scaler=scaler)
        scales.append(stats["loss_scale"])
    assert scales == [2.0**10, 2.0**11, 2.0**12]      # clean steps: the scale grows every growth_interval
