"""What a practitioner expects of the SFT recipe (course_lib/recipes/sft.py), on the tiny model in this process:
bad input ends in one line with nothing written, truncation is counted, held-out loss and samples, bf16 export
that reloads with identical logits, checkpoint rotation, QLoRA refused on CPU; LoRA as peft users run it (a bf16
base, checkpoints of the adapters alone, the merge peft makes or the adapter alone, the memory plan it measures)."""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_export_is_the_checkpoint, tensor_names

import course_lib as cl
from course_lib.sft import data as D
from course_lib.sft import model_dir as M
from course_lib.config import ConfigError
from course_lib.parallel.dist import RESULTS_VAR, read_results
from course_lib.recipes import sft
from course_lib.paths import REPO_ROOT

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


def test_qlora_and_deepspeeds_fp16_need_a_gpu_and_lora_refuses_full_sharding():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="--qlora needs a CUDA GPU"):
        sft.Config(model_path="m", data_dir="d", out_dir="o", qlora=True)
    with pytest.raises(ConfigError, match="not --fsdp"):
        sft.Config(model_path="m", data_dir="d", out_dir="o", lora=True, fsdp=True)
    with pytest.raises(ConfigError, match="fp16 under DeepSpeed needs a CUDA GPU"):
        sft.Config(model_path="m", data_dir="d", out_dir="o", precision="fp16", deepspeed="zero2")
    assert sft.Config(model_path="m", data_dir="d", out_dir="o").peak_lr() == 2e-5  # a pretrained model's default
    assert sft.Config(model_path="m", data_dir="d", out_dir="o").seq_len == 2048


def test_one_process_runs_deepspeed_in_a_group_of_one_and_refuses_fsdp_in_one_line(work, tmp_path):
    """`python -m course_lib.recipes.sft --deepspeed zero2` without torchrun, as a user types it (a process of its own:
    DeepSpeed keeps its groups for the process's life): a process group of one (it looked for MPI and raised
    ModuleNotFoundError: mpi4py); --fsdp on one rank ends in one line."""
    cfg = config(work, "one_process_zero2", out_dir=str(tmp_path / "out"), deepspeed="zero2", steps=1, save=False,
                 export=False, samples=0, threads=1)
    (tmp_path / "results").mkdir()
    done = subprocess.run([sys.executable, "-m", "course_lib.recipes.sft", *cfg.to_argv()], cwd=REPO_ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", RESULTS_VAR: str(tmp_path / "results")},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    (res,) = read_results(tmp_path / "results")
    assert res["world_size"] == 1 and res["backend"] == "deepspeed" and math.isfinite(res["loss"][-1])
    with pytest.raises(SystemExit, match="--fsdp needs several ranks: launch with torchrun"):
        sft.train(config(work, "one_process_fsdp", fsdp=True, steps=1, save=False, export=False, samples=0))


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


def test_weight_decay_reaches_the_matrices_only_and_resumes_exactly(work):
    """--weight-decay shrinks the matrices (linear layers, embedding), not the biases or the norms' scales: one step
    with decay and one without differ in every matrix and in nothing else. Its two parameter groups checkpoint and
    resume: the resumed run is the uninterrupted one."""
    wd = dict(steps=1, save=False, lr=1e-2)
    decayed = trained_weights(quick(work, "wd", weight_decay=0.5, **wd))
    plain = trained_weights(quick(work, "no-wd", weight_decay=0.0, **wd))
    assert {k for k in plain if decayed[k].ndim < 2 and not torch.equal(decayed[k], plain[k])} == set()
    assert all(not torch.equal(decayed[k], plain[k]) for k in plain if decayed[k].ndim >= 2)
    assert any(v.ndim < 2 for v in plain.values())  # (there are biases and norms to leave alone)

    run = dict(weight_decay=0.5, steps=4, save_every=2)
    straight, backend = train_with_backend(quick(work, "wd-straight", **run))
    assert [g["weight_decay"] for g in backend.optimizer.param_groups] == [0.5, 0.0]
    halted = quick(work, "wd-resumed", **run, halt_after=2)
    sft.train(halted)
    resumed = sft.train(sft.Config(**{**vars(halted), "halt_after": None, "resume": "auto"}))
    assert resumed["start_step"] == 2 and resumed["loss"] == straight["loss"][2:]


def test_fp16_skips_the_steps_that_overflow_and_resumes_its_loss_scale_exactly(work):
    """--precision fp16 (a GPU without bf16): fp16 autocast over fp32 weights and a dynamic loss scale. Started at a
    scale of 2^40, the first steps' scaled gradients overflow fp16: each such step is skipped (no weight moves, its
    gradient norm is not finite) and the scale falls (here 2^8-fold a skip) until one fits. The scale is in the checkpoint: the resumed run
    is the uninterrupted one (restarted at 2^40, it would skip its first steps again)."""
    class Overflowing(cl.backends.Single):
        def make_scaler(self):
            return torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, backoff_factor=2.0 ** -8)

    def train(cfg):
        made = []
        return sft.train(cfg, backend_factory=lambda c, ctx: made.append(Overflowing(c, ctx)) or made[-1]), made[-1]

    before = M.load_weights(work[1]).state_dict()
    first, backend = train(quick(work, "fp16-one", precision="fp16", steps=1, save=False))
    assert backend.precision == "fp16" and not math.isfinite(first["grad_norm"][0])
    assert all(torch.equal(v, before[k]) for k, v in backend.module.state_dict().items())  # the step was skipped
    assert backend.scaler.get_scale() == 2.0 ** 32

    run = dict(precision="fp16", steps=8, save_every=4)
    straight, backend = train(quick(work, "fp16-straight", **run))
    trained = [math.isfinite(g) for g in straight["grad_norm"]]
    assert not trained[0] and trained[-1] and all(math.isfinite(x) for x in straight["loss"]), straight["grad_norm"]
    assert backend.scaler.get_scale() == 2.0 ** (40 - 8 * trained.index(True))  # 2^8-fold down a skipped step
    halted = quick(work, "fp16-resumed", **run, halt_after=4)
    train(halted)
    resumed, again = train(sft.Config(**{**vars(halted), "halt_after": None, "resume": "auto"}))
    assert resumed["start_step"] == 4 and resumed["loss"] == straight["loss"][4:]
    assert again.scaler.get_scale() == backend.scaler.get_scale()


def test_a_ctrl_c_swallowed_where_it_landed_still_stops_the_run(work, monkeypatch):
    """A Ctrl-C whose KeyboardInterrupt lands where Python swallows it (a finalizer, a callback: "Exception ignored")
    would leave the run training on; the loop remembers the signal and stops at the next step, in one line."""
    import signal

    def swallowing(*args, **kwargs):  # the signal arrives, and its KeyboardInterrupt goes nowhere
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        return []

    monkeypatch.setattr(cl.checkpoint, "keep_newest", swallowing)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a test worker may hold SIGINT ignored)
    try:
        with pytest.raises(sft.RunError, match=r"interrupted at step 1; --resume auto continues from checkpoint-000001"):
            sft.train(quick(work, "swallowed", steps=6, save_every=1))
    finally:
        signal.signal(signal.SIGINT, before)


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
    # event files are named by the second they start in, then a per-process counter: a resume within the same second
    # (which only a test in one process makes) could sort before the run it resumes, its purge then read first
    time.sleep(1 - time.time() % 1 + 0.01)
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
    """A full disk as torch's zip writer reports it: a RuntimeError about a short write, with no errno in its chain."""
    real_save = torch.save
    calls = {"n": 0}

    def fills_up(obj, f, *args, **kwargs):  # the second checkpoint does not fit
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
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
    assert re.fullmatch(r"no space left writing checkpoint-000002 \([\d,.]+ MB free there now; the checkpoints before "
                        r"it are intact\)", message), message
    assert names(Path(cfg.out_dir)) == ["checkpoint-000001"] and not list(Path(cfg.out_dir).glob("*.tmp"))


def test_a_full_disk_at_the_export_ends_in_one_line(work, monkeypatch):
    """safetensors says "No space left on device" in its own error type; the line names the checkpoint to export."""
    class SafetensorError(Exception):
        pass

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    cfg = quick(work, "full-export", steps=1, export=True)
    monkeypatch.setattr(cl.checkpoint, "save_pretrained", full)
    message = str(pytest.raises(SystemExit, sft.main, cfg.to_argv()).value.code)
    assert message.startswith("no space left writing final (") and "checkpoint-000001, is intact" in message, message
    assert not (Path(cfg.out_dir) / "final").exists() and not (Path(cfg.out_dir) / "final.tmp").exists()


def test_a_diverging_run_stops_in_one_line_keeping_its_last_good_checkpoint(work, capsys):
    """--lr 1e5: the loss or the gradient norm turns nan. The run stops at that step with one line and a non-zero exit,
    saves and exports nothing after it; every checkpoint left holds finite weights; no file holds a bare NaN."""
    cfg = quick(work, "diverges", steps=8, save_every=1, lr=1e5, export=True)
    message = str(pytest.raises(SystemExit, sft.main, cfg.to_argv()).value.code)
    assert re.fullmatch(r"step (\d+): the (loss|gradient norm) is nan.*: the run diverged \(--lr 100000 too high\?\) and "
                        r"stopped, this step neither saved nor exported; the last checkpoint, checkpoint-0+(\d+), is "
                        r"from before it", message), message
    step, kept = map(int, re.fullmatch(r"step (\d+):.*checkpoint-0+(\d+), .*", message).groups())
    out = Path(cfg.out_dir)
    assert kept == step - 1 and names(out)[-1] == f"checkpoint-{kept:06d}" and not (out / "final").exists()
    model = M.load_weights(cfg.model_path)
    cl.checkpoint.load_sharded(out / f"checkpoint-{kept:06d}", model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for path in out.rglob("*.json"):
        assert "NaN" not in path.read_text() and "Infinity" not in path.read_text(), path


def test_json_the_recipe_writes_holds_no_bare_nan(tmp_path):
    sft.write_json(tmp_path / "m.json", {"loss": float("nan"), "eval": [{"loss": float("inf")}], "t": torch.tensor(1.5)})
    assert json.loads((tmp_path / "m.json").read_text()) == {"loss": None, "eval": [{"loss": None}], "t": 1.5}


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

def test_the_fingerprint_holds_the_chat_template_saved_apart(work, tmp_path):
    """transformers 5 saves the template in chat_template.jinja: an edited template is another model (the tokens and
    the mask change), for --resume and for `sft.py export`'s model check alike."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(work[1], model)
    assert (model / "chat_template.jinja").is_file() and sft.model_digest(model) == sft.model_digest(work[1])
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(template.replace("<|im_start|>", "<|im_start|> ", 1))
    assert sft.model_digest(model) != sft.model_digest(work[1])


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
    plan = cl.backends.recipe_plan(shape, cfg, 1, native_bf16=False)  # (--precision bf16: bf16 on any hardware)
    assert (plan["params"], plan["grads"], plan["optimizer"]) == (2 * psi + 4 * adapters, 4 * adapters, 8 * adapters)
    two = cl.backends.recipe_plan(shape, sft.Config(**{**vars(cfg), "lora_targets": "q_proj,v_proj"}), 1, False)
    assert two["trainable"] == cl.memory.lora_params(shape, 4, ["q_proj", "v_proj"]) < adapters
    res = sft.train(cfg)
    assert (res["params"], res["trainable"]) == (psi, adapters)
    (rank,) = res["memory"]
    print(f"measured {rank['measured']:,} B, predicted {rank['predicted']:,.0f} B", rank["by_category"])
    assert rank["predicted"] == pytest.approx(rank["measured"], rel=0.10), (rank["by_category"], rank["phases"],
                                                                             rank["predicted_phases"])


def probe_with_and_without(probe: str) -> dict[str, str]:
    """`probe` in a fresh Python, once with argv[1] 'set' (it makes the recipe's call) and once 'default', neither
    with the variables those calls stand in for: the last word each printed."""
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "THP_MEM_ALLOC_ENABLE")}
    return {how: subprocess.run([sys.executable, "-c", probe, how], env=env, capture_output=True, text=True, check=True,
                                timeout=120).stdout.split()[-1] for how in ("set", "default")}


def test_a_cpu_run_returns_freed_blocks_to_the_os():
    """glibc keeps a freed block of a size it saw freed before in its heap (its mmap threshold rises with each
    large free): a rank's resident memory then counts shards and gradients it no longer holds. The recipe sets the
    threshold itself; a freed 8 MiB tensor then leaves resident memory, as it does not without the call."""
    probe = ("import sys, torch\n"
             "from course_lib.recipes import sft\n"
             "if sys.argv[1] == 'set':\n    assert sft.return_freed_memory()\n"
             "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096\n"
             "before = rss()\n"
             "for _ in range(3):\n    x = torch.ones(2 << 20); del x\n"
             "print((rss() - before) / 2**20)\n")
    kept = {how: float(word) for how, word in probe_with_and_without(probe).items()}
    assert kept["set"] < 4 and kept["default"] - kept["set"] >= 7, kept  # MiB resident after the 8 MiB tensors were freed


def test_a_cpu_run_maps_its_large_tensors_in_huge_pages():
    """With freed blocks going back to the system, each large tensor a step makes is memory the kernel maps afresh.
    The recipe has PyTorch's allocator ask for 2 MiB pages (THP_MEM_ALLOC_ENABLE), set after the recipe is imported
    and before its first tensor, as `train` does: 64 MiB made and freed five times then costs a small fraction of
    the page faults it costs without (16,384 a time in 4 KiB pages), where the kernel gives huge pages on request."""
    probe = ("import os, resource, sys, torch\n"
             "from course_lib.recipes import sft\n"
             "if sys.argv[1] == 'set':\n    assert sft.huge_pages_for_tensors() and 'THP_MEM_ALLOC_ENABLE' not in os.environ\n"
             "else:\n    os.environ['THP_MEM_ALLOC_ENABLE'] = '0'\n"
             "sft.return_freed_memory()\n"
             "faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
             "before = faults()\n"
             "for _ in range(5):\n    x = torch.ones(16 << 20); del x\n"
             "print(faults() - before)\n")
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = mode.read_text().split("[")[1].split("]")[0] if mode.exists() else "missing"
    if mode not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {mode} on this machine: the kernel maps no 2 MiB page to ask for")
    faults = {how: int(word) for how, word in probe_with_and_without(probe).items()}
    print("transparent huge pages:", mode, "page faults:", faults)
    if mode == "madvise":  # on request only: the recipe's request is what makes the difference
        assert faults["set"] * 10 < faults["default"], faults
    assert faults["set"] * 10 < 5 * 16_384, faults


# --- the training loop as a practitioner reads it: log lines, --epochs, the held-out split, samples, run files ---
LOG_LINE = re.compile(r"step (\d+)/(\d+) \| epoch ([\d.]+) \| loss ([\d.]+) \| lr ([\d.e+-]+) \| grad norm ([\d.]+) \| "
                      r"([\d,]+) tokens/s \| peak RSS ([\d,]+) MB$")
EVAL_LINE = re.compile(r"eval step (\d+): loss ([\d.]+), perplexity ([\d.]+)$")


def test_the_command_logs_each_n_steps_through_the_bar_and_writes_its_config_and_metrics(work, tmp_path):
    """As typed, with the progress bar on (stdout and stderr in one stream, as a terminal shows them): a line every
    --log-every steps and at the last, each starting a line of its own (printed through the bar, not after it); the
    epoch the steps reached, the real tokens a second over the steps since the line before (the test counts them
    from the data order), the peak RSS; each held-out loss as it is taken; config.json and metrics.json in --out-dir;
    --samples; and no DeepSpeed line (the export imports DeepSpeed where it is installed). The rank's process, at its
    exit, has loaded no module of the workbook (notebook-side code): a sitecustomize on its path lists its modules."""
    cfg = config(work, "logged", out_dir=str(tmp_path / "out"), steps=5, log_every=2, eval_every=2, samples=2,
                 threads=1, progress=True)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    (tmp_path / "results").mkdir()
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(
        "import atexit, os, sys\n"
        "atexit.register(lambda: open(os.environ['MODULES_OUT'], 'w').write('\\n'.join(sorted(sys.modules))))\n")
    path = os.pathsep.join(filter(None, [str(probe), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "course_lib.recipes.sft", *cfg.to_argv()], cwd=REPO_ROOT,
                          env={**env, "HF_HUB_OFFLINE": "1", RESULTS_VAR: str(tmp_path / "results"),
                               "PYTHONPATH": path, "MODULES_OUT": str(tmp_path / "modules.txt")},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    text = done.stdout
    assert done.returncode == 0, text[-3000:]
    assert "DeepSpeed" not in text and "Setting accelerator" not in text and "[WARNING]" not in text, text[-3000:]
    (result,) = read_results(tmp_path / "results")
    loaded = (tmp_path / "modules.txt").read_text().split()
    assert "course_lib.sft.backends" in loaded and not [m for m in loaded if m.startswith("course_lib.workbook")]
    pieces = re.split(r"[\r\n]", text)  # what follows a carriage return or a newline: the start of a line on screen
    lines = [LOG_LINE.match(p) for p in pieces if LOG_LINE.match(p)]
    assert [int(m[1]) for m in lines] == [2, 4, 5], text[-3000:]
    assert len(lines) == text.count(" tokens/s | "), "a log line was printed after the bar, on its line"
    tok = M.load_tokenizer(cfg.model_path)
    rows, _ = D.tokenize_chats(D.read_chats(Path(cfg.data_dir) / "train.jsonl"), tok, cfg.seq_len)
    real = [sum(len(rows[i]["input_ids"]) for i in D.step_indices(s, len(rows), 4, cfg.seed)) for s in range(5)]
    since = 0
    for m in lines:
        step = int(m[1])
        assert int(m[2]) == 5 and float(m[3]) == pytest.approx(step * 4 / len(rows), abs=0.0051)
        assert float(m[4]) == pytest.approx(result["loss"][step - 1], abs=1e-4)
        assert float(m[5]) == pytest.approx(result["lr"][step - 1], rel=1e-3)
        assert float(m[6]) == pytest.approx(result["grad_norm"][step - 1], abs=1e-3)
        want = sum(real[since:step]) / sum(result["seconds"][since:step])
        assert int(m[7].replace(",", "")) == pytest.approx(want, rel=0.01, abs=1)
        assert 50 < int(m[8].replace(",", "")) <= result["peak_rss_per_rank"][0] / 1e6 + 1
        since = step
    evals = [EVAL_LINE.match(p) for p in pieces if EVAL_LINE.match(p)]
    assert [int(m[1]) for m in evals] == [2, 4, 5]
    assert all(float(m[3]) == pytest.approx(math.exp(float(m[2])), rel=1e-3) for m in evals)

    out = Path(cfg.out_dir)
    assert not list(out.glob("*.tmp")), "a .tmp was left behind"
    written = json.loads((out / "config.json").read_text())
    assert written["config"] == {f.name: getattr(cfg, f.name) for f in dataclasses.fields(sft.Config)}
    assert (written["world_size"], written["precision"], written["backend"]) == (1, "fp32", "single")
    assert (written["steps"], written["global_batch"], written["train_rows"]) == (5, 4, len(rows))
    assert written["epochs"] == pytest.approx(5 * 4 / len(rows)) and written["held_out"] == {"from": "eval.jsonl",
                                                                                          "conversations": 4}
    figures = json.loads((out / "metrics.json").read_text())
    assert (figures["steps"], figures["last_step"], figures["halted"]) == (5, 5, False)
    assert figures["final_loss"] == pytest.approx(float(lines[-1][4]), abs=1e-4)
    assert [round(e["loss"], 4) for e in figures["eval"]] == [float(m[2]) for m in evals]
    assert figures["held_out_loss"] == figures["eval"][-1]["loss"]
    assert figures["tokens_per_s"] > 0 and figures["seconds"] > 0 and figures["epochs"] == written["epochs"]
    assert len(figures["peak_rss_per_rank"]) == 1 and figures["peak_rss_per_rank"][0] > 50e6
    assert len((out / "samples.jsonl").read_text().splitlines()) == 2  # --samples 2 of the 4 held out


def test_epochs_give_the_steps_that_cover_them(work, capsys):
    """--epochs E: rows x E / global batch steps, rounded up; the start line says steps and epochs for either flag."""
    res = sft.train(quick(work, "epochs", steps=None, epochs=0.5, save=False))  # 64 conversations, batch 4
    assert res["steps"] == 8 and len(res["loss"]) == 8 and res["epochs"] == 0.5
    assert "training 8 steps = 0.50 epochs of 64 rows (global batch 4 = --micro-batch 4 x --accum 1 x 1 rank)" \
        in capsys.readouterr().out
    res = sft.train(quick(work, "epochs-accum", steps=None, epochs=0.3, accum=3, save=False))  # 64 x 0.3 / 12: 1.6
    assert res["steps"] == 2 and len(res["loss"]) == 2
    sft.train(quick(work, "steps", steps=6, save=False))
    assert "training 6 steps = 0.38 epochs of 64 rows" in capsys.readouterr().out


def test_without_eval_jsonl_a_seeded_part_of_train_jsonl_is_held_out(work, tmp_path, capsys):
    """No eval.jsonl: --eval-n conversations of train.jsonl (at most a tenth) are held out, drawn by --seed, and
    trained on no more; the held-out loss and the samples use them. --max-new-tokens caps each sample's answer."""
    root, _ = work
    (tmp_path / "data").mkdir()
    chats = D.read_chats(root / "data" / "train.jsonl")
    (tmp_path / "data" / "train.jsonl").write_text((root / "data" / "train.jsonl").read_text())
    cfg = quick(work, "split", data_dir=str(tmp_path / "data"), out_dir=str(tmp_path / "out"), eval_n=200, steps=2,
                max_new_tokens=1, save=False)
    res = sft.train(cfg)
    out = capsys.readouterr().out
    assert "no eval.jsonl in " in out and ": 6 of 64 conversations of train.jsonl held out (drawn by --seed 0)" in out
    assert res["data"]["examples"] == 58 and len(res["eval"]) == 1 and res["held_out_from"] == "train.jsonl"
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    held = [c for c in chats if c["messages"][-1]["content"] in {s["reference"] for s in samples}]
    assert len(samples) == 6 and len(held) == 6  # six conversations of train.jsonl
    tok = M.load_tokenizer(cfg.model_path)
    assert all(len(tok(s["answer"], add_special_tokens=False)["input_ids"]) <= 1 for s in samples)  # --max-new-tokens 1
    again, other = sft.hold_out(chats, 200, 0), sft.hold_out(chats, 200, 1)
    assert [c for c in chats if c not in again[0]] == again[1] == held  # the same draw; trained on no more
    assert other[1] != held and len(other[1]) == 6


def test_warmup_ratio_sets_the_warmup_and_warmup_wins(work):
    """--warmup-ratio R: the lr climbs over R x steps steps (rounded down), then the cosine; --warmup N wins."""
    res = sft.train(quick(work, "ratio", steps=10, warmup_ratio=0.5, save=False))
    assert res["lr"][:6] == pytest.approx([0, 2e-4, 4e-4, 6e-4, 8e-4, 1e-3])
    res = sft.train(quick(work, "ratio-default", steps=10, save=False))  # 0.1: one step, as "10% of --steps" was
    assert res["lr"][:2] == pytest.approx([0, 1e-3])
    res = sft.train(quick(work, "warmup-wins", steps=10, warmup=2, warmup_ratio=0.5, save=False))
    assert res["lr"][:3] == pytest.approx([0, 5e-4, 1e-3])


def test_attn_picks_the_attention_kernel(work):
    _, backend = train_with_backend(quick(work, "eager", steps=1, attn="eager", save=False))
    assert backend.module.config._attn_implementation == "eager"
    _, backend = train_with_backend(quick(work, "sdpa", steps=1, save=False))
    assert backend.module.config._attn_implementation == "sdpa"


def test_with_pack_the_log_line_counts_no_filler(work, capsys):
    """--pack fills each row's end with filler (D.pack): the log line's tokens/s counts the examples' tokens only.
    One step over every packed row: its real tokens are all the examples' tokens, however they were packed."""
    cfg = quick(work, "packed", pack=True, seq_len=96, save=False, steps=1)
    tok = M.load_tokenizer(cfg.model_path)
    rows, _ = D.tokenize_chats(D.read_chats(Path(cfg.data_dir) / "train.jsonl"), tok, cfg.seq_len)
    from datasets import Dataset

    packed = len(D.pack(Dataset.from_list(rows), cfg.seq_len))
    res = sft.train(dataclasses.replace(cfg, micro_batch=packed))
    line = next(LOG_LINE.match(x) for x in capsys.readouterr().out.splitlines() if LOG_LINE.match(x))
    want = sum(len(r["input_ids"]) for r in rows) / res["seconds"][0]
    assert packed * cfg.seq_len > sum(len(r["input_ids"]) for r in rows)  # there is filler to leave out
    assert int(line[7].replace(",", "")) == pytest.approx(want, rel=0.01)


def test_a_resumed_run_writes_its_config_and_metrics_again(work, tmp_path):
    cfg = quick(work, "files", out_dir=str(tmp_path / "out"), steps=4, save_every=2, halt_after=2)
    sft.train(cfg)
    out = tmp_path / "out"
    first = json.loads((out / "metrics.json").read_text())
    assert (first["last_step"], first["halted"], json.loads((out / "config.json").read_text())["start_step"]) == \
        (2, True, 0)
    sft.train(dataclasses.replace(cfg, halt_after=None, resume="auto"))
    again, written = json.loads((out / "metrics.json").read_text()), json.loads((out / "config.json").read_text())
    assert (again["start_step"], again["last_step"], again["halted"], written["start_step"]) == (2, 4, False, 2)
    assert written["config"]["resume"] == "auto" and not list(out.glob("*.tmp"))


def test_a_global_batch_larger_than_the_data_is_said(work, tmp_path, capsys):
    data = tmp_path / "data"
    D.write_jsonl([SYSTEM_CHAT] * 3, data / "train.jsonl")
    sft.train(quick(work, "small-data", steps=1, data_dir=str(data), save=False))
    assert "warning: the global batch (4) is larger than the training data (3 rows)" in capsys.readouterr().out


def test_one_sharegpt_parquet_file_a_config_file_and_eval_split(work, tmp_path, capsys):
    """A ShareGPT parquet file as --data-dir, flags in --config run.yaml (the command line overriding it), and
    --eval-split: a seeded fraction held out, named in a line, and trained on no more."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, base = work
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    chats = D.read_chats(root / "data" / "train.jsonl")
    pq.write_table(pa.Table.from_pylist([{"conversations": [{"from": speaker[m["role"]], "value": m["content"]}
                                                            for m in c["messages"]]} for c in chats]),
                   tmp_path / "chats.parquet")
    (tmp_path / "run.yaml").write_text(f"model-path: {base}\ndata-dir: {tmp_path / 'chats.parquet'}\neval-split: 0.1\n"
                                       f"out-dir: {tmp_path / 'out'}\nsteps: 9\nseq_len: 96\nlr: 1e-3\n")
    res = sft.main(["--config", str(tmp_path / "run.yaml"), "--steps", "2", "--precision", "fp32", "--no-progress",
                    "--threads", "1", "--no-save", "--no-export", "--samples", "0", "--micro-batch", "4"])
    out = capsys.readouterr().out
    assert "chats.parquet: 6 of 64 conversations of chats.parquet held out (--eval-split 0.1, drawn by --seed 0)" in out
    assert res["data"]["examples"] == 58 and len(res["eval"]) == 1 and res["held_out_from"] == "chats.parquet"
    ran = json.loads((tmp_path / "out" / "config.json").read_text())["config"]
    assert (ran["steps"], ran["eval_split"], ran["seq_len"]) == (2, 0.1, 96)  # the command line over the file


def test_keep_best_scores_every_checkpoint_and_keeps_the_best_beside_the_last(work, capsys):
    cfg = config(work, "best", steps=4, save_every=1, keep_last=1, keep_best=True, lr=0.3, threads=1, export=False,
                 samples=0)  # too high an lr: the held-out loss rises after a step, the best is not the last
    res = sft.train(cfg)
    losses = {e["step"]: e["loss"] for e in res["eval"]}
    assert sorted(losses) == [1, 2, 3, 4]  # every checkpoint scored once (the last one too, not again at the end)
    best = min(losses, key=losses.get)
    assert best != 4
    kept = ck_names(Path(cfg.out_dir))
    assert kept == sorted({f"checkpoint-{best:06d}", "checkpoint-000004"})
    for name in kept:
        assert cl.checkpoint.read_meta(Path(cfg.out_dir) / name)["eval_loss"] == losses[int(name[-6:])]
    assert res["best_checkpoint"]["step"] == best and f"best checkpoint: {Path(cfg.out_dir) / f'checkpoint-{best:06d}'}" \
        in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--keep-best compares the held-out loss"):
        config(work, "x", keep_best=True, eval_n=0)


def ck_names(out: Path) -> list[str]:
    return [p.name for p in cl.checkpoint.complete(out)]


def test_a_default_run_checkpoints_during_a_long_run_and_only_at_the_end_of_a_short_one(work, monkeypatch):
    """No --save-every: a run shorter than the interval (sft.SAVE_SECONDS of training) writes only its last checkpoint,
    as before; one longer than it has checkpoints before its end, so a Ctrl-C leaves one to resume."""
    short = quick(work, "default-short", steps=3)
    assert short.save_every is None
    sft.train(short)
    assert names(Path(short.out_dir)) == ["checkpoint-000003"]
    monkeypatch.setattr(sft, "SAVE_SECONDS", 0.0)  # every step ends past the interval: a long run, in short
    long = quick(work, "default-long", steps=6, halt_after=3)  # stopped at step 3 of 6, as a Ctrl-C would
    sft.train(long)
    assert names(Path(long.out_dir)) == ["checkpoint-000001", "checkpoint-000002", "checkpoint-000003"]
    explicit = quick(work, "explicit-zero", steps=3, save_every=0)  # --save-every 0: only the end, whatever the time
    sft.train(explicit)
    assert names(Path(explicit.out_dir)) == ["checkpoint-000003"]


def test_tokenized_data_is_cached_and_rebuilt_when_its_inputs_change(work, tmp_path, monkeypatch, capsys):
    """The first load tokenizes and writes the cache; a second reads it (no tokenization, one line saying so); an
    edited chat template or data file is another key, tokenized again; --data-cache off never reads it."""
    root, base = work
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.jsonl", "eval.jsonl"):
        (data / name).write_text((root / "data" / name).read_text())
    calls = []
    real = D.tokenize_chats
    monkeypatch.setattr(D, "tokenize_chats", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = config(work, "cache", data_dir=str(data), data_cache=str(tmp_path / "cache"))
    tok = M.load_tokenizer(base)

    def load():
        calls.clear()
        capsys.readouterr()
        out = sft.load_data(cfg, tok)
        return len(calls), "read from the cache" in capsys.readouterr().out, out

    n, noted, first = load()
    assert (n, noted) == (2, False) and len(list((tmp_path / "cache").glob("*.pt"))) == 1  # train and eval, written
    n, noted, again = load()
    assert (n, noted) == (0, True)
    assert {k: again[k] for k in ("rows", "stats", "eval_rows")} == {k: first[k] for k in ("rows", "stats", "eval_rows")}
    tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")  # an edited template
    assert load()[:2] == (2, False)
    (data / "train.jsonl").write_text((data / "train.jsonl").read_text().replace("Reverse", "Reverse:"))
    assert load()[:2] == (2, False)
    assert load()[:2] == (0, True)
    cfg = sft.Config(**{**vars(cfg), "data_cache": "off"})
    assert load()[:2] == (2, False)


def test_rank_0_tokenizes_once_and_the_other_ranks_read_what_it_wrote(tmp_path):
    """sft.tokenized_once with two ranks (a store as torchrun's, in a dict): rank 0 builds and writes, rank 1 waits for
    its word and reads the file; where rank 0's build fails, rank 1 builds too and fails the same way; where rank 0
    could not write the file, rank 1 tokenizes itself."""
    class Store(dict):
        def set(self, key, value):
            self[key] = value.encode()

        def wait(self, keys, timeout):
            assert all(k in self for k in keys), "rank 1 would wait for ever"

        def get(self, key):
            return self[key]

    def ctx(rank):
        return cl.dist.Context(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))

    built = []
    parts = {"train": ([{"input_ids": [1, 2, 3], "labels": [D.IGNORE, 2, 3]}], {"examples": 1})}

    def build():
        built.append(1)
        return parts

    store, path = Store(), tmp_path / "cache" / "k.pt"
    assert sft.tokenized_once(path, build, ctx(0), store) == parts
    assert sft.tokenized_once(path, build, ctx(1), store) == parts and len(built) == 1  # read, not built
    store, path = Store(), tmp_path / "cache" / "bad.pt"

    def fails():
        raise D.ChatFormatError("train.jsonl:3: unknown role 'robot'")

    for rank in (0, 1):
        with pytest.raises(D.ChatFormatError, match="unknown role"):
            sft.tokenized_once(path, fails, ctx(rank), store)
    store, path = Store(), tmp_path / "not-a-dir"
    path.write_text("")  # (a file where the cache directory should be: rank 0 cannot write under it)
    built.clear()
    assert sft.tokenized_once(path / "k.pt", build, ctx(0), store) == parts
    assert sft.tokenized_once(path / "k.pt", build, ctx(1), store) == parts and len(built) == 2
