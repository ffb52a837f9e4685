"""Bad input to the SFT recipe, as a practitioner types it: `python -m course_lib.recipes.sft ...` ends with one
line on stderr that starts with `error:` (Ctrl-C: `interrupted at step N; --resume auto continues`), a non-zero exit
code, and no checkpoint half-written. Each case is checked before the model loads where it can be.

A subprocess costs ~7 s of imports (torch, transformers): one bad-input case and Ctrl-C run as the command; the other
cases run the command's own entry point, `sft.main(argv)`, in this process, with what the interpreter does with what it
raises and the stderr a fresh process would print (`run_in_process`)."""
import importlib.util
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from transformers.utils import logging as hf_logging

from course_lib.sft import data as D
from course_lib.sft import model_dir as M
from course_lib.recipes import sft
from course_lib.config import ConfigError
from course_lib.paths import REPO_ROOT

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
CHAT = {"messages": [{"role": "user", "content": "Reverse 12"}, {"role": "assistant", "content": "21"}]}
STDERR_AT_IMPORT = sys.stderr  # what a logging handler made at import time writes to (under pytest: not fd 2)


@contextmanager
def recipe_state_kept():
    """The process-wide settings a run changes (torch's threads, deterministic algorithms, the seeds, transformers'
    progress bars), as they were: a run in this process leaves the later tests as it found them."""
    threads, progress = torch.get_num_threads(), hf_logging.is_progress_bar_enabled()
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    py_rng, np_rng = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        random.setstate(py_rng)
        np.random.set_state(np_rng)
        (hf_logging.enable_progress_bar if progress else hf_logging.disable_progress_bar)()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny model, its data, and a finished 2-step full fine-tune with a checkpoint at each step (`run/`)."""
    root = tmp_path_factory.mktemp("sft_inputs")
    train, held_out = D.make_examples(n_train=64, n_eval=4)
    D.write_jsonl(train, root / "data" / "train.jsonl")
    D.write_jsonl(held_out, root / "data" / "eval.jsonl")
    base = M.make_tiny_checkpoint(root / "base", D.chat_corpus(train), TINY, vocab_size=300)
    with recipe_state_kept():
        sft.train(sft.Config(**base_args(root, base, "run"), save_every=1))
    return root, base


def base_args(root, base, out="out") -> dict:
    return dict(model_path=str(base), data_dir=str(root / "data"), out_dir=str(root / out), steps=2, micro_batch=4,
                seq_len=64, lr=1e-3, eval_n=0, export=False, precision="fp32", progress=False, threads=1)


def argv(args: dict, extra: list[str]) -> list[str]:
    return [*sft.Config(**args).to_argv(), *extra]


def command(args: dict, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "course_lib.recipes.sft", *argv(args, extra)]


def run(args: dict, extra: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(command(args, extra), cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def run_in_process(args: dict, extra: list[str], capfd, monkeypatch) -> subprocess.CompletedProcess:
    """`run`'s command in this process: `sft.main` (what `python -m course_lib.recipes.sft` calls) on the same argv,
    its SystemExit turned into an exit code and stderr as the interpreter turns it. Its stderr holds what a fresh
    process would print there: what reached fd 2 (logging handlers made at import time moved onto it), the warnings
    Python's default filters show (`-m` runs sft.py as __main__), and the log records logging's last resort prints."""
    capfd.readouterr()  # (what came before the command)
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # (read from the environment at import)
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and handler.stream is STDERR_AT_IMPORT:
                monkeypatch.setattr(handler, "stream", sys.stderr)
    for once in (hf_logging.warning_once, hf_logging.info_once):  # transformers': once per process
        once.cache_clear()
    last_resort = logging.StreamHandler(sys.stderr)  # pytest's handlers on the root logger keep logging's from it
    last_resort.setLevel(logging.WARNING)
    threads = set(threading.enumerate())
    code, error = 0, ""
    logging.getLogger().addHandler(last_resort)
    try:
        with recipe_state_kept(), warnings.catch_warnings(record=True) as shown:
            warnings.resetwarnings()
            for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
                warnings.simplefilter("ignore", category)
            warnings.filterwarnings("default", category=DeprecationWarning, module=re.escape(sft.__name__))
            try:
                sft.main(argv(args, extra))
            except SystemExit as e:  # as the interpreter ends on it: None 0, a number itself, else printed and 1
                code, error = (e.code, "") if e.code is None or isinstance(e.code, int) else (1, f"{e.code}\n")
            except BaseException:
                code, error = 1, traceback.format_exc()
    finally:
        logging.getLogger().removeHandler(last_resort)
    out, err = capfd.readouterr()
    err += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in shown)
    left = [t.name for t in threading.enumerate() if t not in threads]
    assert not left, f"the run left threads behind: {left}"
    return subprocess.CompletedProcess(argv(args, extra), code or 0, out, err + error)


def copy_data(root: Path, tmp: Path) -> Path:
    shutil.copytree(root / "data", tmp / "data")
    return tmp / "data"


def copy_run(root: Path, tmp: Path, keep=("checkpoint-000001", "checkpoint-000002")) -> Path:
    out = tmp / "resumed"
    for name in keep:
        shutil.copytree(root / "run" / name, out / name)
    return out


# Each case: (what it is, how to make it: fn(root, base, tmp) -> (args, extra flags), what the line must say).
def non_utf8(root, base, tmp):
    data = copy_data(root, tmp)
    (data / "train.jsonl").write_bytes(json.dumps(CHAT).encode() + b"\n" + b'{"messages": "caf\xe9"}\n')
    return dict(base_args(root, base), data_dir=str(data)), []


def truncated_weights(root, base, tmp):
    model = tmp / "model"
    shutil.copytree(base, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    return dict(base_args(root, base), model_path=str(model)), []


def out_dir_is_a_file(root, base, tmp):
    (tmp / "a-file").write_text("")
    return dict(base_args(root, base), out_dir=str(tmp / "a-file")), []


def out_dir_not_writable(root, base, tmp):
    # sysfs takes no files, root's or anyone's: as a read-only mount or a directory of another user refuses them
    return dict(base_args(root, base), out_dir="/sys/sft-out"), []


def model_without_template(root, base, tmp):
    model = tmp / "model"
    shutil.copytree(base, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    return dict(base_args(root, base), model_path=str(model)), []


def tokens_added_without_resizing(root, base, tmp):
    """The model's vocabulary smaller than the tokenizer's (tokens added to the tokenizer, the model not resized)."""
    model = tmp / "model"
    shutil.copytree(base, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 10}))
    return dict(base_args(root, base), model_path=str(model)), []


def flags(*extra):
    return lambda root, base, tmp: (dict(base_args(root, base), out_dir=str(tmp / "out")), list(extra))


def resumed_with(**changes):
    def make(root, base, tmp):
        return dict(base_args(root, base), out_dir=str(copy_run(root, tmp)), resume="auto", **changes), []
    return make


def only_checkpoint_truncated(root, base, tmp):
    out = copy_run(root, tmp, keep=("checkpoint-000001",))
    metadata = out / "checkpoint-000001" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:20])
    return dict(base_args(root, base), out_dir=str(out), resume="auto"), []


def one_conversation_no_eval_file(root, base, tmp):
    (tmp / "data").mkdir()
    (tmp / "data" / "train.jsonl").write_text(json.dumps(CHAT) + "\n")
    return dict(base_args(root, base), data_dir=str(tmp / "data"), eval_n=4), []


def flags_without_steps(*extra):
    return lambda root, base, tmp: (dict(base_args(root, base), out_dir=str(tmp / "out"), steps=None), list(extra))


BAD_INPUT = {
    "non-UTF-8 byte": (non_utf8, "train.jsonl:2: not UTF-8 (byte 0xe9"),
    "truncated model.safetensors": (truncated_weights, "model.safetensors is cut short"),
    "--out-dir is a file": (out_dir_is_a_file, "is a file"),
    "--out-dir not writable": (out_dir_not_writable, "--out-dir /sys/sft-out: cannot write in /sys"),
    "a model without a chat template": (model_without_template, "has no chat template"),
    "tokens added to the tokenizer, the model not resized": (tokens_added_without_resizing,
                                                             "but the model's vocabulary has 10 rows"),
    "--warmup 50 --steps 2": (flags("--warmup", "50"), "--warmup 50 is longer than --steps 2"),
    "--min-lr-ratio 2": (flags("--min-lr-ratio", "2"), "--min-lr-ratio is a fraction"),
    "--lr -1": (flags("--lr", "-1"), "--lr must be > 0"),
    "--deepspeed zero9": (flags("--deepspeed", "zero9"), "no DeepSpeed config 'zero9': use one of zero0"),
    "--lora-r 0": (flags("--lora", "--lora-r", "0"), "--lora-r must be >= 1"),
    "--lora-targets nope_proj": (flags("--lora", "--lora-targets", "nope_proj"), "nope_proj is not a linear layer"),
    "resume a full fine-tune with --lora": (resumed_with(lora=True), "--lora (False there, True here)"),
    "resume with another --micro-batch": (resumed_with(micro_batch=2), "the global batch"),
    "resume with another --steps": (resumed_with(steps=5), "--steps (2 there, 5 here)"),
    "the only checkpoint truncated": (only_checkpoint_truncated, "checkpoint-000001 will not load"),
    "one conversation and no eval.jsonl": (one_conversation_no_eval_file, "too few to hold any out"),
    "--steps 2 --epochs 1": (flags("--epochs", "1"), "give --steps or --epochs, not both"),
    "--epochs 0": (flags_without_steps("--epochs", "0"), "--epochs must be > 0"),
    "--epochs -1": (flags_without_steps("--epochs", "-1"), "--epochs must be > 0"),
    "--warmup-ratio 2": (flags("--warmup-ratio", "2"), "--warmup-ratio is a fraction of the steps"),
    "--warmup-ratio -0.1": (flags("--warmup-ratio", "-0.1"), "--warmup-ratio is a fraction of the steps"),
    "--samples -1": (flags("--samples", "-1"), "--samples must be >= 0"),
    "--max-new-tokens 0": (flags("--max-new-tokens", "0"), "--max-new-tokens must be >= 1"),
    "--log-every 0": (flags("--log-every", "0"), "--log-every must be >= 1"),
    "--attn nope": (flags("--attn", "nope"), "--attn must be sdpa, eager or flash_attention_2"),
    "--attn flash_attention_2 without its kernels": (flags("--attn", "flash_attention_2"),
                                                     "--attn flash_attention_2 needs"),
    "resume with another --warmup-ratio": (resumed_with(warmup_ratio=0.5), "--warmup-ratio (0.1 there, 0.5 here)"),
    "a hub dataset, offline": (flags("--data", "someorg/no-such-chats"),
                               "someorg/no-such-chats: no such file or directory, and "
                               "datasets.load_dataset('someorg/no-such-chats') failed"),
}
if torch.cuda.is_available() and importlib.util.find_spec("flash_attn"):  # there it is no bad input
    del BAD_INPUT["--attn flash_attention_2 without its kernels"]


# As the user types it, in a subprocess: the case that goes furthest (it loads the model and the checkpoint) and
# would leave the most behind in this process. The others run in this process (`run_in_process`).
AS_TYPED = "the only checkpoint truncated"


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_ends_in_one_error_line(work, tmp_path, case, capfd, monkeypatch):
    root, base = work
    make, says = BAD_INPUT[case]
    args, extra = make(root, base, tmp_path)
    before = sorted(p.name for p in Path(args["out_dir"]).glob("checkpoint-*")) if Path(args["out_dir"]).is_dir() else []
    done = run(args, extra) if case == AS_TYPED else run_in_process(args, extra, capfd, monkeypatch)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0, done.stdout[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-3000:]
    assert says in lines[0], lines[0]
    out = Path(args["out_dir"])
    after = sorted(p.name for p in out.glob("checkpoint-*")) if out.is_dir() else []
    assert after == before, "a failed run wrote, or removed, a checkpoint"


def test_ctrl_c_says_where_it_stopped_and_how_to_go_on(work, tmp_path):
    root, base = work
    args = dict(base_args(root, base), out_dir=str(tmp_path / "out"), steps=100_000, save_every=1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # started as from a terminal, SIGINT at its default: an xdist worker (or a suite started with `&` or nohup) has it
    # ignored, which a child inherits, and a run started that way rightly ignores Ctrl-C
    proc = subprocess.Popen(command(args, []), cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (tmp_path / "out" / "checkpoint-000002").is_dir() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert proc.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("interrupted at step "), err[-3000:]
    assert "; --resume auto continues from checkpoint-" in lines[0]
    assert not list((tmp_path / "out").glob("*.tmp")), "the interrupted save left its temporary directory"


def test_epochs_and_steps_parse_back_from_the_command_line():
    """A config with --epochs (a notebook launches it with `cfg.to_argv()`) parses back as it was: no --steps then;
    a config with neither runs the default steps."""
    given = dict(model_path="m", data_dir="d", out_dir="o")
    for cfg in (sft.Config(**given, steps=None, epochs=2.5), sft.Config(**given, steps=7), sft.Config(**given)):
        assert sft.Config.parse(cfg.to_argv()) == cfg
    assert (sft.Config(**given).steps, sft.Config(**given, steps=None, epochs=1).steps) == (sft.DEFAULT_STEPS, None)


def test_an_unknown_deepspeed_config_is_refused_before_anything_is_read():
    """The config itself refuses it: no data read, no model loaded (the directories here do not exist)."""
    with pytest.raises(ConfigError, match=r"--deepspeed zero9: no DeepSpeed config 'zero9'"):
        sft.Config(model_path="m", data_dir="d", out_dir="o", deepspeed="zero9")
    assert sft.Config(model_path="m", data_dir="d", out_dir="o", deepspeed="zero2").deepspeed == "zero2"


def test_lora_is_refused_under_a_stage_3_config_of_ones_own(tmp_path):
    """ZeRO-3 is read from the config's stage, not its name: a .json of one's own counts too."""
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    for config in ("zero3", "zero3_offload", str(mine)):
        with pytest.raises(ConfigError, match="LoRA trains ~1% of the weights"):
            sft.Config(model_path="m", data_dir="d", out_dir="o", deepspeed=config, lora=True)
    mine.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert sft.Config(model_path="m", data_dir="d", out_dir="o", deepspeed=str(mine), lora=True).lora


def test_a_config_file_holds_the_flags_and_the_command_line_overrides_it(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("model-path: m\ndata_dir: d\nout-dir: o\nlr: 1e-3\nlora: true\nsteps: 5\n")
    (tmp_path / "run.json").write_text(json.dumps({"model_path": "m", "data-dir": "d", "out_dir": "o", "lr": 0.001,
                                                   "lora": True, "steps": 5}))
    for name in ("run.yaml", "run.json"):
        cfg = sft.Config.parse(["--config", str(tmp_path / name), "--steps", "7", "--no-lora"])
        assert cfg == sft.Config(model_path="m", data_dir="d", out_dir="o", lr=1e-3, steps=7)
        assert sft.Config.parse([f"--config={tmp_path / name}"]) == sft.Config(model_path="m", data_dir="d",
                                                                               out_dir="o", lr=1e-3, lora=True, steps=5)
    (tmp_path / "bad.yaml").write_text("lr: 1\nlearning_rate: 2\n")
    with pytest.raises(SystemExit) as end:
        sft.Config.parse(["--config", str(tmp_path / "bad.yaml")])
    err = capsys.readouterr().err
    assert end.value.code == 2 and err.count("\n") == 1 and "unknown key learning_rate" in err


def test_a_name_that_is_no_local_path_is_loaded_from_the_hub(work, monkeypatch):
    """`--data owner/name` where no such path exists: `datasets.load_dataset(name)`, its train split trained, its test
    split held out, rows in any format read (ShareGPT here); a local path of the same spelling stays a path."""
    import datasets

    root, base = work
    asked = []
    sharegpt = [{"conversations": [{"from": "human", "value": f"Reverse {n}"}, {"from": "gpt", "value": str(n)[::-1]}]}
                for n in range(100, 130)]

    def load_dataset(name, *args, **kw):
        asked.append((name, args, kw))
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(sharegpt[:25]),
                                     "test": datasets.Dataset.from_list(sharegpt[25:])})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg = sft.Config.parse(argv(dict(base_args(root, base), eval_n=3), ["--data", "someorg/chats"]))
    train, held, split = sft.read_split(cfg)
    assert asked == [("someorg/chats", (), {})]
    assert (len(train), len(held), split) == (25, 3, 0)
    assert train[0] == {"messages": [{"role": "user", "content": "Reverse 100"}, {"role": "assistant", "content": "001"}]}
    assert sft.held_out_from(cfg, {"split": 0, "held_out": held}) == "someorg/chats (held-out split)"
    monkeypatch.chdir(root)  # `data` is a directory here: a path, never a hub name
    assert not D.is_hub_name("data") and D.is_hub_name("no-such-dir") and not D.is_hub_name("train.jsonl")
