"""What a practitioner expects of the SFT recipe (course_lib/recipes/sft.py), on the tiny model in this process:
bad input ends in one line with nothing written, truncation is counted, held-out loss and samples, bf16 export
that reloads with identical logits, checkpoint rotation, QLoRA refused on CPU; LoRA as peft users run it (a bf16
base, checkpoints of the adapters alone, the merge peft makes or the adapter alone, the memory plan it measures)."""
import json
from pathlib import Path

import pytest
import torch
from conftest import assert_export_is_the_checkpoint, tensor_names

import course_lib as cl
from course_lib import data as D
from course_lib import model_dir as M
from course_lib.config import ConfigError
from course_lib.recipes import sft

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
SYSTEM = {"role": "system", "content": "You reverse digits."}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_recipe")
    train, held_out = D.make_examples(n_train=128, n_eval=6)
    # multi-turn conversations with a system prompt: every assistant turn is trained
    chats = [{"messages": [SYSTEM, *a["messages"], *b["messages"]]} for a, b in zip(train[::2], train[1::2])]
    D.write_jsonl(chats, root / "data" / "train.jsonl")
    D.write_jsonl([{"messages": [SYSTEM, *r["messages"]]} for r in held_out], root / "data" / "eval.jsonl")
    base = M.make_tiny_checkpoint(root / "base", D.chat_corpus(train), TINY, vocab_size=300)
    return root, base


def config(work, name, **kw):
    root, base = work
    defaults = dict(model_path=str(base), data_dir=str(root / "data"), out_dir=str(root / name), steps=3,
                    micro_batch=4, seq_len=96, lr=1e-3, eval_n=4, precision="fp32", progress=False)
    return sft.Config(**{**defaults, **kw})


def one_line_error(cfg, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        sft.main(cfg.to_argv())
    message = str(exit_.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    assert not capsys.readouterr().out.strip()  # no traceback, no half-done report
    return message


def test_bad_input_ends_in_one_line_and_writes_nothing(work, tmp_path, capsys):
    root, base = work
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert "missing tokenizer.json" in one_line_error(config(work, "x", model_path=str(empty), out_dir=str(tmp_path / "o1")), capsys)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                                     '{"messages": [{"role": "user", "content": "hi"}\n')
    (bad / "eval.jsonl").write_text((root / "data" / "eval.jsonl").read_text())
    assert f"{bad / 'train.jsonl'}:2: not valid JSON" in one_line_error(config(work, "x", data_dir=str(bad), out_dir=str(tmp_path / "o2")), capsys)
    (bad / "train.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert ":1: the conversation has no assistant turn" in one_line_error(config(work, "x", data_dir=str(bad), out_dir=str(tmp_path / "o3")), capsys)
    (bad / "train.jsonl").write_text('{"messages": [{"role": "robot", "content": "hi"}]}\n')
    assert "unknown role 'robot'" in one_line_error(config(work, "x", data_dir=str(bad), out_dir=str(tmp_path / "o4")), capsys)
    assert "raise --seq-len" in one_line_error(config(work, "x", seq_len=8, out_dir=str(tmp_path / "o5")), capsys)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6)), "a failed start left files behind"


def test_truncation_is_counted_and_examples_without_targets_are_dropped(work):
    _, base = work
    tok = M.load_tokenizer(base)
    rows = [{"messages": [{"role": "user", "content": "Reverse " + "1" * n}, {"role": "assistant", "content": "21"}]}
            for n in (2, 30)]
    out, stats = D.tokenize_chats(rows, tok, max_len=20)
    assert stats["examples"] == 2 and stats["dropped"] == 1 and stats["truncated"] == 1 and len(out) == 1
    assert stats["target_tokens"] == 3  # "2", "1", <|im_end|>
    line = D.describe_truncation(stats, 20)
    assert line.startswith("warning: 1 of 2 examples dropped") and "--seq-len 20" in line


def test_a_run_evaluates_samples_exports_and_rotates(work):
    cfg = config(work, "run", steps=4, save_every=1, keep_last=2, eval_every=2)
    res = sft.train(cfg)
    out = Path(cfg.out_dir)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000003", "checkpoint-000004"]
    assert [e["step"] for e in res["eval"]] == [2, 4] and all(e["perplexity"] > 1 for e in res["eval"])
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and samples[0]["step"] == 4 and samples[0]["prompt"].startswith("Reverse")
    # the loss was taken on every assistant turn of the multi-turn chats: two answers per conversation
    tok = M.load_tokenizer(cfg.model_path)
    rows, stats = D.tokenize_chats(D.read_chats(Path(cfg.data_dir) / "train.jsonl"), tok, cfg.seq_len)
    assert stats["dropped"] == 0 and res["data"] == stats
    first = D.step_indices(0, len(rows), cfg.micro_batch, cfg.seed)
    assert res["targets"][0] == sum(sum(t != D.IGNORE for t in rows[i]["labels"][1:]) for i in first)
    # the export: bf16 safetensors that from_pretrained loads as they are, with the final weights
    assert_export_is_the_checkpoint(out / "final", Path(cfg.model_path), out / "checkpoint-000004")


def test_lora_exports_the_merge_peft_makes_or_with_no_merge_the_adapter_alone(work, monkeypatch):
    """--lora-targets all-linear, end to end. The merged export is, tensor for tensor, what peft's merge_and_unload
    makes of the adapter on the bf16 base, laid out as the base, and it is built from the trained model: the run
    loads the model once. --no-merge exports final/adapter alone, the trained adapters, which PeftModel loads."""
    from peft import PeftModel

    load_weights, loads = M.load_weights, []
    monkeypatch.setattr(M, "load_weights", lambda *a, **kw: loads.append(a) or load_weights(*a, **kw))
    cfg = config(work, "lora", lora=True, lora_r=4, precision="bf16", lora_targets="all-linear", steps=2)
    res = sft.train(cfg)
    assert len(loads) == 1, loads  # the base, to train: not again to merge
    monkeypatch.undo()
    assert 0 < res["trainable"] < res["params"] / 10 and res["lr_peak"] == 1e-3
    final, base = Path(res["final_dir"]), Path(cfg.model_path)
    adapter = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == sorted(cl.models.LORA_TARGETS)
    # the merged model holds the base checkpoint's tensors (the tied head once) and its generation settings
    assert tensor_names(final) == tensor_names(base)
    assert (final / "generation_config.json").read_text() == (base / "generation_config.json").read_text()
    merged = M.load_weights(final, dtype="auto")  # the merged model loads alone, in bf16
    peft_merge = PeftModel.from_pretrained(M.load_weights(base, torch.bfloat16), final / "adapter").merge_and_unload()
    want = peft_merge.state_dict()
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, want[name]) for name, t in merged.state_dict().items())

    cfg = config(work, "lora-adapter", lora=True, lora_r=4, merge=False, eval_n=0, steps=2)
    res, backend = train_with_backend(cfg)
    final = Path(res["final_dir"])
    assert not list(final.glob("*.safetensors")) and (final / "adapter" / "adapter_model.safetensors").is_file()
    loaded = PeftModel.from_pretrained(M.load_weights(base), final / "adapter").state_dict()
    trained = [(n, p) for n, p in backend.module.named_parameters() if p.requires_grad]
    assert trained and all(torch.equal(p, loaded[n]) for n, p in trained)


def test_qlora_needs_a_gpu_and_lora_refuses_full_sharding():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="--qlora needs a CUDA GPU"):
        sft.Config(model_path="m", data_dir="d", out_dir="o", qlora=True)
    with pytest.raises(ConfigError, match="not --fsdp"):
        sft.Config(model_path="m", data_dir="d", out_dir="o", lora=True, fsdp=True)
    assert sft.Config(model_path="m", data_dir="d", out_dir="o").peak_lr() == 2e-5  # a pretrained model's default
    assert sft.Config(model_path="m", data_dir="d", out_dir="o").seq_len == 2048


def test_the_lora_base_and_export_flags_are_checked():
    with pytest.raises(ConfigError, match="--no-merge is for --lora/--qlora"):
        sft.Config(model_path="m", data_dir="d", out_dir="o", merge=False)
    with pytest.raises(ConfigError, match="--lora-base-dtype must be auto or fp32, got 'bf16'"):
        sft.Config(model_path="m", data_dir="d", out_dir="o", lora=True, lora_base_dtype="bf16")


def test_a_run_that_cannot_fit_its_budget_stops_before_loading(work, tmp_path, capsys):
    message = one_line_error(config(work, "x", memory_budget=0.001, out_dir=str(tmp_path / "o")), capsys)
    assert "predicted peak" in message and "over the budget of 0.00 GB" in message and "--act-ckpt" in message
    assert not (tmp_path / "o").exists()


def quick(work, name, **kw):
    """A short run without evaluation or export: what the checkpoint and resume tests need."""
    return config(work, name, **{**dict(steps=2, eval_n=0, export=False, threads=1), **kw})


def train_with_backend(cfg) -> tuple[dict, object]:
    """`sft.train(cfg)`'s result and the backend it trained with."""
    made = []

    def make(c, ctx):
        made.append(cl.backends.make(c, ctx))
        return made[-1]

    return sft.train(cfg, backend_factory=make), made[-1]


def trained_weights(cfg) -> dict:
    return {k: v.detach().clone() for k, v in train_with_backend(cfg)[1].module.state_dict().items()}


def test_clip_zero_means_no_clipping(work):
    """`--clip 0` is "no clipping" (as in HF Trainer): the same step as an unreachable max norm, not a zeroed gradient."""
    before = M.load_weights(work[1]).state_dict()
    unclipped = trained_weights(quick(work, "clip0", clip=0.0, steps=1, save=False))
    huge = trained_weights(quick(work, "clip-huge", clip=1e30, steps=1, save=False))
    assert max((unclipped[k] - before[k]).abs().max().item() for k in before) > 0, "--clip 0 trained nothing"
    assert all(torch.equal(unclipped[k], huge[k]) for k in before)


def names(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("checkpoint-*"))


def test_a_reused_out_dir_keeps_its_runs_apart(work, capsys):
    """A second run in the --out-dir of a first one: --keep-last deletes only its own checkpoints, `--resume auto`
    continues its own run (saying so), and resuming under a setting that changes the data order or the schedule
    stops with one line unless --allow-mismatch."""
    first = quick(work, "reused", steps=4, save_every=4)
    sft.train(first)
    second = quick(work, "reused", steps=3, save_every=1, keep_last=2, lr=5e-4)
    capsys.readouterr()
    sft.train(second)
    assert "note: --out-dir holds 1 checkpoint(s) of an earlier run (the newest checkpoint-000004)" in capsys.readouterr().out
    out = Path(first.out_dir)
    assert names(out) == ["checkpoint-000002", "checkpoint-000003", "checkpoint-000004"]  # the first run's is kept
    meta = cl.checkpoint.read_meta(out / "checkpoint-000003")
    assert meta["config"]["lr"] == 5e-4 and meta["fingerprint"]["steps"] == 3
    assert cl.checkpoint.read_meta(out / "checkpoint-000004")["run"] != meta["run"]
    capsys.readouterr()
    res = sft.train(sft.Config(**{**vars(second), "resume": "auto"}))
    assert res["start_step"] == 3 and len(res["loss"]) == 0  # its own newest, not the other run's step 4
    assert f"--resume auto: found {out / 'checkpoint-000003'}" in capsys.readouterr().out
    changed = sft.Config(**{**vars(second), "resume": "auto", "steps": 5})
    message = str(pytest.raises(SystemExit, sft.main, changed.to_argv()).value.code)
    assert message.startswith("error: ") and "\n" not in message
    assert "was written by another run" in message and "--steps (4 there, 5 here)" in message
    assert "--allow-mismatch" in message
    res = sft.train(sft.Config(**{**vars(changed), "allow_mismatch": True}))
    assert res["start_step"] == 4 and len(res["loss"]) == 1
    empty = quick(work, "fresh-dir", resume="auto", steps=1, save=False)
    sft.train(empty)
    assert "--resume auto: no checkpoint in" in capsys.readouterr().out


def tensorboard_steps(out: Path, tag: str = "loss") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return sorted(e.step for e in events.Scalars(tag))


def test_resume_appends_to_tensorboard(work):
    cfg = quick(work, "tb", steps=4, save_every=1, log_every=1, halt_after=2)
    sft.train(cfg)
    sft.train(sft.Config(**{**vars(cfg), "halt_after": None, "resume": "auto"}))
    assert tensorboard_steps(Path(cfg.out_dir)) == [1, 2, 3, 4]


def test_a_resumed_run_shows_the_steps_it_repeats_once_in_tensorboard(work):
    """Interrupted after logging step 3, before checkpointing it: the run resumed from step 2 logs step 3 again, and
    TensorBoard shows it once (the interrupted run's events after step 2 are purged), the steps before kept."""
    import shutil

    cfg = quick(work, "tb-repeat", steps=4, save_every=2, log_every=1, halt_after=3)
    sft.train(cfg)
    out = Path(cfg.out_dir)
    shutil.rmtree(out / "checkpoint-000003")  # the interruption came before this save
    res = sft.train(sft.Config(**{**vars(cfg), "halt_after": None, "resume": "auto"}))
    assert res["start_step"] == 2
    assert tensorboard_steps(out) == [1, 2, 3, 4]


def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(work, capsys):
    cfg = quick(work, "damaged", steps=3, save_every=1, halt_after=2)
    sft.train(cfg)
    out = Path(cfg.out_dir)
    metadata = out / "checkpoint-000002" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:20])  # a copy or a disk cut short
    capsys.readouterr()
    res = sft.train(sft.Config(**{**vars(cfg), "resume": "auto"}))
    assert res["start_step"] == 1
    assert "checkpoint-000002 will not load" in capsys.readouterr().out
    record = out / "checkpoint-000002" / cl.checkpoint.MARKER  # written again by the resumed run, now cut short
    record.write_text(record.read_text()[:30])
    res = sft.train(sft.Config(**{**vars(cfg), "halt_after": None, "resume": "auto"}))
    assert res["start_step"] == 1 and "checkpoint-000002 will not load" in capsys.readouterr().out


def test_a_full_disk_ends_in_one_line_and_leaves_the_last_checkpoint(work, monkeypatch, capsys):
    import errno

    real_save = torch.save
    calls = {"n": 0}

    def fills_up(obj, f, *args, **kwargs):  # the second checkpoint does not fit
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    cfg = quick(work, "full-disk", steps=2, save_every=1)
    real_train = cl.backends.Single.save

    def counting_save(self, path, meta):
        if path.name.endswith("000002"):
            monkeypatch.setattr(torch, "save", fills_up)
        return real_train(self, path, meta)

    monkeypatch.setattr(cl.backends.Single, "save", counting_save)
    message = str(pytest.raises(SystemExit, sft.main, cfg.to_argv()).value.code)
    monkeypatch.undo()
    assert message == "no space left writing checkpoint-000002 (the checkpoints before it are intact)"
    assert names(Path(cfg.out_dir)) == ["checkpoint-000001"] and not list(Path(cfg.out_dir).glob("*.tmp"))


def test_lora_targets_are_checked_before_the_model_loads(work):
    assert sft.lora_targets(config(work, "x", lora=True, lora_targets="all-linear")) == sorted(cl.models.LORA_TARGETS)
    with pytest.raises(ConfigError, match="nope_proj is not a linear layer of this model"):
        sft.lora_targets(config(work, "x", lora=True, lora_targets="q_proj,nope_proj"))


def test_the_fingerprint_names_what_changed(work, tmp_path):
    cfg = config(work, "x")
    run = sft.fingerprint(cfg, world_size=1)
    assert sft.differences(run, sft.fingerprint(cfg, world_size=1)) == []
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(Path(cfg.data_dir, "train.jsonl").read_text() + json.dumps(SYSTEM_CHAT) + "\n")
    other = sft.fingerprint(config(work, "x", data_dir=str(data), micro_batch=2), world_size=1)
    assert sft.differences(run, other) == ["other training data (train.jsonl)",
                                           "the global batch (--micro-batch x --accum x ranks) (4 there, 2 here)"]
    assert sft.differences({}, run) == ["it records no fingerprint of the run that wrote it"]


SYSTEM_CHAT = {"messages": [SYSTEM, {"role": "user", "content": "Reverse 12"}, {"role": "assistant", "content": "21"}]}


def test_empty_assistant_turns_are_trained_with_a_warning(work, tmp_path, capsys):
    root, _ = work
    data = tmp_path / "data"
    data.mkdir()
    empty = {"messages": [{"role": "user", "content": "Say nothing"}, {"role": "assistant", "content": ""}]}
    (data / "train.jsonl").write_text((root / "data" / "train.jsonl").read_text() + json.dumps(empty) + "\n")
    sft.train(quick(work, "empty", data_dir=str(data), steps=1, save=False))
    assert "warning: empty assistant turns in train.jsonl: 1 (only their end-of-turn token" in capsys.readouterr().out


def stored_names(checkpoint: Path) -> set[str]:
    """The names of the tensors (and other values) a DCP checkpoint stores."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)


def test_lora_holds_a_bf16_base_checkpoints_its_adapters_alone_and_resumes_exactly(work, tmp_path):
    """--lora where the run computes in bf16: the frozen base in bf16 (2 bytes a weight, as peft users load it), the
    adapters and their AdamW moments in fp32. A checkpoint holds those alone (the base is --model-path's), and the
    run resumed from it is the uninterrupted run, dropout's draws included; onto another base it stops in one line."""
    import shutil

    from safetensors.torch import load_file, save_file

    lora = dict(lora=True, lora_r=4, precision="bf16", steps=4, save_every=2)
    cfg = quick(work, "lora-straight", **lora)
    res, backend = train_with_backend(cfg)
    params = list(backend.module.named_parameters())
    assert {p.dtype for _, p in params if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for _, p in params if p.requires_grad} == {torch.float32}
    assert {t.dtype for s in backend.optimizer.state.values() for k, t in s.items() if k != "step"} == {torch.float32}
    stored = stored_names(Path(cfg.out_dir) / "checkpoint-000002")
    assert {n for n in stored if n.startswith("model.")} == {f"model.{n}" for n, p in params if p.requires_grad}

    halted = quick(work, "lora-resumed", **lora, halt_after=2)
    sft.train(halted)
    resumed, again = train_with_backend(sft.Config(**{**vars(halted), "halt_after": None, "resume": "auto"}))
    assert resumed["start_step"] == 2 and resumed["loss"] == res["loss"][2:]
    after = dict(again.module.named_parameters())
    assert all(torch.equal(p, after[n]) for n, p in params)

    other = tmp_path / "another-base"
    shutil.copytree(work[1], other)
    weights = load_file(other / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"another model \(--model-path\)"):
        sft.train(sft.Config(**{**vars(halted), "model_path": str(other), "halt_after": None, "resume": "auto"}))


def test_the_memory_plan_is_lora_as_the_recipe_runs_it(work):
    """`recipe_plan` (which --memory-budget reads) counts what --lora holds: a bf16 base where the run computes in
    bf16 (2 bytes a weight), fp32 adapters on --lora-targets with fp32 gradients and AdamW moments (16 bytes each);
    and it predicts the measured peak of live tensor bytes of a step (--memory-trace: the second, AdamW's moments
    made) within 10%."""
    from transformers import AutoConfig

    cfg = quick(work, "lora-memory", lora=True, lora_r=4, precision="bf16", save=False, memory_trace=True)
    shape = AutoConfig.from_pretrained(cfg.model_path)
    psi, adapters = cl.memory.count_params(shape), cl.memory.lora_params(shape, 4)
    plan = cl.memory.recipe_plan(shape, cfg, 1, native_bf16=False)  # (--precision bf16: bf16 on any hardware)
    assert (plan["params"], plan["grads"], plan["optimizer"]) == (2 * psi + 4 * adapters, 4 * adapters, 8 * adapters)
    two = cl.memory.recipe_plan(shape, sft.Config(**{**vars(cfg), "lora_targets": "q_proj,v_proj"}), 1, False)
    assert two["trainable"] == cl.memory.lora_params(shape, 4, ["q_proj", "v_proj"]) < adapters
    res = sft.train(cfg)
    assert (res["params"], res["trainable"]) == (psi, adapters)
    (rank,) = res["memory"]
    print(f"measured {rank['measured']:,} B, predicted {rank['predicted']:,.0f} B", rank["by_category"])
    assert rank["predicted"] == pytest.approx(rank["measured"], rel=0.10), (rank["by_category"], rank["phases"],
                                                                             rank["predicted_phases"])


def test_a_cpu_run_returns_freed_blocks_to_the_os():
    """glibc keeps a freed block of a size it saw freed before in its heap (its mmap threshold rises with each
    large free): a rank's resident memory then counts shards and gradients it no longer holds. The recipe sets the
    threshold itself; a freed 8 MiB tensor then leaves resident memory, as it does not without the call."""
    import os
    import subprocess
    import sys

    probe = ("import sys, torch\n"
             "from course_lib.recipes import sft\n"
             "if sys.argv[1] == 'set':\n    assert sft.return_freed_memory()\n"
             "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096\n"
             "before = rss()\n"
             "for _ in range(3):\n    x = torch.ones(2 << 20); del x\n"
             "print((rss() - before) / 2**20)\n")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    kept = {how: float(subprocess.run([sys.executable, "-c", probe, how], env=env, capture_output=True, text=True,
                                      check=True, timeout=120).stdout.split()[-1]) for how in ("set", "default")}
    assert kept["set"] < 4 and kept["default"] - kept["set"] >= 7, kept  # MiB resident after the 8 MiB tensors were freed

