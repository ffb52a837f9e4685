"""course_lib.sft.checkpoint: atomic saves (an interrupted save keeps the last good checkpoint), DCP round trips
of model + optimizer in one process, and the full-state-dict export. Fast: small models, no launch."""
import json

import pytest
import torch

from course_lib.sft import checkpoint as ck


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def step(model, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def same_weights(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_atomic_directory_swaps_in_only_when_complete(tmp_path):
    path = tmp_path / "ckpt"
    assert ck.resolve(path) is None
    with ck.atomic_directory(path, meta={"step": 1}) as tmp:
        assert tmp != path and tmp.parent == path.parent
        (tmp / "weights").write_text("one")
        assert not path.exists()  # nothing visible before the block ends
    assert ck.resolve(path) == path and ck.read_meta(path) == {"step": 1}
    with ck.atomic_directory(path, meta={"step": 2}) as tmp:
        (tmp / "weights").write_text("two")
    assert (path / "weights").read_text() == "two" and ck.read_meta(path)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .tmp or .prev left behind


def test_interrupted_save_keeps_the_last_good_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    with ck.atomic_directory(path, meta={"step": 1}) as tmp:
        (tmp / "weights").write_text("good")
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C (or any crash) half-way through writing
        with ck.atomic_directory(path, meta={"step": 2}) as tmp:
            (tmp / "weights").write_text("half")
            raise KeyboardInterrupt
    assert ck.read_meta(path) == {"step": 1} and (path / "weights").read_text() == "good"
    assert not (tmp_path / "ckpt.tmp").exists()


def test_killed_save_leftovers_are_ignored_and_cleaned(tmp_path):
    path = tmp_path / "ckpt"
    with ck.atomic_directory(path, meta={"step": 1}) as tmp:
        (tmp / "weights").write_text("good")
    stale = tmp_path / "ckpt.tmp"  # what a SIGKILLed save leaves: no marker, never loaded
    stale.mkdir()
    (stale / "weights").write_text("partial")
    assert ck.resolve(path) == path
    with ck.atomic_directory(path, meta={"step": 3}) as tmp:
        assert not (tmp / "weights").exists()  # started clean
        (tmp / "weights").write_text("new")
    assert ck.read_meta(path)["step"] == 3


def test_crash_between_the_two_renames_falls_back_to_prev(tmp_path):
    path, prev = tmp_path / "ckpt", tmp_path / "ckpt.prev"
    with ck.atomic_directory(path, meta={"step": 1}) as tmp:
        (tmp / "weights").write_text("good")
    path.rename(prev)  # the state after the first rename of a swap, before the second
    assert ck.resolve(path) == prev and ck.read_meta(path) == {"step": 1}
    with ck.atomic_directory(path, meta={"step": 2}) as tmp:  # the next save keeps .prev until it is done
        assert ck.resolve(path) == prev
        (tmp / "weights").write_text("next")
    assert ck.resolve(path) == path and not prev.exists()


def test_incomplete_directory_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "weights").write_text("no marker")
    assert ck.resolve(path) is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ck.read_meta(path)


def test_dcp_roundtrip_model_and_optimizer_resumes_exactly(tmp_path):
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(3):
        step(model, opt, s)
    ck.save_sharded(tmp_path / "dcp", model, opt, meta={"step": 3})
    straight = [step(model, opt, s) for s in range(3, 6)]

    other = small_model(seed=1)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    assert not same_weights(model, other)
    meta = ck.load_sharded(tmp_path / "dcp", other, other_opt)
    assert meta == {"step": 3}
    assert [step(other, other_opt, s) for s in range(3, 6)] == straight  # bit-identical
    assert same_weights(model, other)
    assert json.loads((tmp_path / "dcp" / ck.MARKER).read_text())["step"] == 3


def test_a_frozen_weight_is_not_saved_and_stays_as_loaded(tmp_path):
    """A checkpoint holds what trains and its optimizer state: a frozen weight (LoRA's base) comes from where the
    model was loaded. Loaded into a model made the same way, the run goes on exactly."""
    import torch.distributed.checkpoint as dcp

    def partly_frozen():
        model = small_model()
        model[0].requires_grad_(False)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    model, opt = partly_frozen()
    for s in range(3):
        step(model, opt, s)
    ck.save_sharded(tmp_path / "dcp", model, opt, meta={"step": 3})
    stored = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    assert sorted(n for n in stored if n.startswith("model.")) == ["model.2.bias", "model.2.weight"]
    straight = [step(model, opt, s) for s in range(3, 6)]

    other, other_opt = partly_frozen()
    assert not same_weights(model, other)  # (the trained layer differs until the checkpoint loads)
    assert ck.load_sharded(tmp_path / "dcp", other, other_opt) == {"step": 3}
    assert [step(other, other_opt, s) for s in range(3, 6)] == straight  # bit-identical
    assert same_weights(model, other)


def test_dcp_model_only_and_interrupted_save(tmp_path, monkeypatch):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, opt, 0)
    ck.save_sharded(tmp_path / "dcp", model, meta={"step": 1})
    good = {k: v.clone() for k, v in model.state_dict().items()}
    step(model, opt, 1)

    import torch.distributed.checkpoint as dcp
    real_save = dcp.save

    def crash_midway(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)  # the shards are written...
        raise RuntimeError("node lost")  # ...but the save never finishes

    monkeypatch.setattr(dcp, "save", crash_midway)
    with pytest.raises(RuntimeError, match="node lost"):
        ck.save_sharded(tmp_path / "dcp", model, meta={"step": 2})
    monkeypatch.undo()
    fresh = small_model(seed=5)
    assert ck.load_sharded(tmp_path / "dcp", fresh) == {"step": 1}
    assert all(torch.equal(v, good[k]) for k, v in fresh.state_dict().items())


def test_load_without_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ck.load_sharded(tmp_path / "missing", small_model())


def test_full_state_dict_and_save_full_plain_module(tmp_path):
    model = small_model()
    state = ck.full_state_dict(model)
    assert set(state) == set(model.state_dict()) and all(v.device.type == "cpu" for v in state.values())
    ck.save_full(tmp_path / "full", model, meta={"kind": "plain"})
    loaded = small_model(seed=3)
    loaded.load_state_dict(torch.load(tmp_path / "full" / "model.pt"))
    assert same_weights(model, loaded)


def test_save_full_hf_model_loads_into_plain_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    import course_lib as cl

    model = cl.models.tiny_qwen2(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=64, vocab_size=64)
    ck.save_full(tmp_path / "hf", model)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_keep_newest_rotates_only_the_named_run(tmp_path):
    for step, run in ((12, "old"), (1, "new"), (2, "new"), (3, "new")):
        with ck.atomic_directory(tmp_path / f"checkpoint-{step:06d}", meta={"step": step, "run": run}):
            pass
    ck.keep_newest(tmp_path, 2, run="new")
    assert [p.name for p in ck.complete(tmp_path)] == ["checkpoint-000002", "checkpoint-000003", "checkpoint-000012"]
    (tmp_path / "checkpoint-000003").rename(tmp_path / "checkpoint-000003.prev")  # a crash inside a swap
    (tmp_path / "checkpoint-000004.tmp").mkdir()  # a save killed half-way
    assert [p.name for p in ck.complete(tmp_path)] == ["checkpoint-000002", "checkpoint-000003.prev",
                                                       "checkpoint-000012"]


def test_ctrl_c_inside_a_sharded_save_stays_a_ctrl_c_and_leaves_no_tmp(tmp_path, monkeypatch):
    """DCP wraps what a rank raises in its own CheckpointException (a BaseException, a traceback per rank): a Ctrl-C
    while it writes comes out as the KeyboardInterrupt it is, the half-written directory is gone, the last good stays."""
    model = small_model()
    ck.save_sharded(tmp_path / "dcp", model, meta={"step": 1})

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)  # what DCP's file writer calls for each item
    with pytest.raises(KeyboardInterrupt):
        ck.save_sharded(tmp_path / "dcp", model, meta={"step": 2})
    monkeypatch.undo()
    assert ck.read_meta(tmp_path / "dcp") == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]


def test_ctrl_c_that_surfaces_as_the_writers_own_error_stays_a_ctrl_c(tmp_path, monkeypatch):
    """A SIGINT that lands while torch.save's zip writer is in C++ surfaces as the writer's error when it finishes
    the cut-short file ("unexpected pos"), not as a KeyboardInterrupt: the save still ends as a Ctrl-C."""
    import os
    import signal

    model = small_model()
    ck.save_sharded(tmp_path / "dcp", model, meta={"step": 1})
    # Python's own handler, whatever an earlier test in this worker left (xdist workers may have SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)

    def cut_short(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Python raises it at the next bytecode: here
            for _ in range(1000):
                pass
        except KeyboardInterrupt:
            pass  # what the C++ writer cannot pass on
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 450 vs 337")

    monkeypatch.setattr(torch, "save", cut_short)
    with pytest.raises(KeyboardInterrupt):
        ck.save_sharded(tmp_path / "dcp", model, meta={"step": 2})
    monkeypatch.undo()
    assert ck.read_meta(tmp_path / "dcp") == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]
    try:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler given back
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_process_that_ignores_ctrl_c_saves_through_one(tmp_path):
    """Started with SIGINT ignored (`nohup`, `&` in a script, an xdist worker), a run keeps ignoring it, inside a save
    too: the save completes and the ignore stays installed."""
    import os
    import signal

    model = small_model()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with ck.atomic_directory(tmp_path / "dcp", {"step": 1}) as tmp:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
            torch.save(model.state_dict(), tmp / "weights.pt")
        assert ck.read_meta(tmp_path / "dcp") == {"step": 1}
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_keep_best_keeps_the_lowest_eval_loss_beside_the_newest(tmp_path):
    for step, loss in ((1, 2.0), (2, 1.5), (3, None), (4, 1.7), (5, 1.9)):
        with ck.atomic_directory(tmp_path / f"checkpoint-{step:06d}", meta={"step": step, "run": "r", "eval_loss": loss}):
            pass
    with ck.atomic_directory(tmp_path / "checkpoint-000009", meta={"step": 9, "run": "other", "eval_loss": 0.1}):
        pass
    assert ck.best(tmp_path, run="r").name == "checkpoint-000002" and ck.best(tmp_path).name == "checkpoint-000009"
    ck.keep_newest(tmp_path, 2, run="r", keep_best=True)
    assert [p.name for p in ck.complete(tmp_path)] == ["checkpoint-000002", "checkpoint-000004", "checkpoint-000005",
                                                       "checkpoint-000009"]
    ck.keep_newest(tmp_path, 1, run="r")  # without --keep-best: the newest only
    assert [p.name for p in ck.complete(tmp_path)] == ["checkpoint-000005", "checkpoint-000009"]
