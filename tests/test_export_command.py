"""`sft.py export`: any checkpoint of an SFT run as a Hugging Face directory, on one process, with nothing given but
the checkpoint. An intermediate checkpoint exports its own weights (the same logits); the last one exports, file for
file, what the run's own final export wrote: for one process, for LoRA (the merge, the adapter, or with --no-merge
the adapter alone) and for 2-rank DeepSpeed runs in bf16 (ZeRO-3; LoRA under ZeRO-2). Bad input ends in one `error:` line, nothing
written; a moved model is found again with --model-path, and another model is refused."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_export_is_the_checkpoint, downloaded_like_checkpoint, tensor_names

import course_lib as cl
from course_lib.sft import model_dir as M
from course_lib.recipes import sft

pytestmark = pytest.mark.xdist_group("export_command")  # one worker: the runs below are made once, for all the tests

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
# as Qwen2.5-Instruct ships: the KV cache on in its config, its own sampling settings


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_command")
    base = downloaded_like_checkpoint(root, TINY)
    return root, base


def recipe_config(work, name: str, **kw) -> sft.Config:
    """Two steps, a checkpoint after each, the final export."""
    root, base = work
    settings = dict(steps=2, save_every=1, micro_batch=4, seq_len=96, lr=1e-3, eval_n=0, precision="fp32",
                    progress=False, threads=1)
    return sft.Config(model_path=str(base), data_dir=str(root / "data"), out_dir=str(root / name), **{**settings, **kw})


@pytest.fixture(scope="module")
def single(work) -> Path:
    cfg = recipe_config(work, "single")
    sft.train(cfg)
    return Path(cfg.out_dir)


@pytest.fixture(scope="module")
def lora(work) -> Path:
    """LoRA where the run computes in bf16: a bf16 base, fp32 adapters, all linear layers adapted."""
    cfg = recipe_config(work, "lora", lora=True, lora_r=4, precision="bf16", lora_targets="all-linear")
    sft.train(cfg)
    return Path(cfg.out_dir)


# 2 ranks in bf16: the engine holds bf16 copies of its fp32 master weights (ZeRO-3: partitioned; with LoRA under
# ZeRO-2 it saves the adapters alone)
DEEPSPEED = {"zero3": dict(deepspeed="zero3", export_dtype="fp32"), "zero2-lora": dict(deepspeed="zero2", lora=True, lora_r=4)}


@pytest.fixture(scope="module", params=sorted(DEEPSPEED))
def deepspeed_run(request, work) -> tuple[str, Path]:
    cfg = recipe_config(work, request.param, precision="bf16", **DEEPSPEED[request.param])
    res = cl.launch(cfg, nproc=2, launcher="deepspeed", timeout=300, env={"OMP_NUM_THREADS": "1"}).result
    assert res["backend"] == "deepspeed" and res["world_size"] == 2
    return request.param, Path(cfg.out_dir)


def export(checkpoint: Path, out: Path, *flags) -> dict:
    """`sft.py export CHECKPOINT --out OUT FLAGS...`, in this process."""
    return sft.main(["export", str(checkpoint), "--out", str(out), *map(str, flags)])


def files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def assert_same_export(ours: Path, run: Path) -> None:
    """Two exports hold the same files, byte for byte, except the record, where ours also names its checkpoint, and
    peft's adapter config, whose target modules come in any order."""
    assert files(ours) == files(run)
    for name in files(run):
        if name == cl.checkpoint.MARKER:
            mine, theirs = read_json(ours / name), read_json(run / name)
            assert {k: mine[k] for k in theirs} == theirs and "checkpoint" in mine
        elif name.endswith("adapter_config.json"):  # peft writes its target modules, a set, in the process's hash order
            mine, theirs = read_json(ours / name), read_json(run / name)
            for config in (mine, theirs):
                config["target_modules"] = sorted(config["target_modules"])
            assert mine == theirs
        else:
            assert (ours / name).read_bytes() == (run / name).read_bytes(), name


def test_an_intermediate_checkpoint_exports_its_weights_from_the_command_line(single, work, tmp_path):
    checkpoint, out = single / "checkpoint-000001", tmp_path / "step1"
    done = subprocess.run([sys.executable, "-m", "course_lib.recipes.sft", "export", str(checkpoint), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [f"read {checkpoint} (step 1, DCP, model {work[1]}); wrote {out}: the model in "
                                        f"bf16, {sum((out / f).stat().st_size for f in files(out)) / 1e6:,.1f} MB"]
    assert_export_is_the_checkpoint(out, work[1], checkpoint)
    # laid out as the source: its tensors (the tied head once), its use_cache, its generation settings
    assert tensor_names(out) == tensor_names(work[1])
    assert read_json(out / "config.json")["use_cache"] is True
    assert read_json(out / "generation_config.json") == read_json(work[1] / "generation_config.json")
    assert {k: read_json(out / cl.checkpoint.MARKER)[k] for k in ("checkpoint", "step")} == \
        {"checkpoint": str(checkpoint.resolve()), "step": 1}


def test_the_last_checkpoint_exports_what_the_run_exported(single, tmp_path, capsys):
    out = tmp_path / "step2"
    export(single / "checkpoint-000002", out)
    assert_same_export(out, single / "final")
    export(single / "checkpoint-000002", out)  # again: an export of the same checkpoint is replaced
    assert_same_export(out, single / "final")
    with pytest.raises(SystemExit, match=r"^error: --out .* is no export of .*checkpoint-000001"):
        export(single / "checkpoint-000001", out)
    assert_same_export(out, single / "final")


def test_a_lora_checkpoint_exports_its_merge_and_its_adapter(lora, work, tmp_path):
    """The merged model is peft's merge of the checkpoint's adapters onto the bf16 base; the adapter is the
    checkpoint's; the last checkpoint gives the run's own final/, and with --no-merge its adapter alone."""
    from peft import PeftModel

    base, checkpoint, out = work[1], lora / "checkpoint-000001", tmp_path / "step1"
    export(checkpoint, out)
    recorded = cl.checkpoint.read_meta(checkpoint)["config"]
    reference = cl.models.add_lora(M.load_weights(base, torch.bfloat16), 4, recorded["lora_alpha"], 0.0,
                                   cl.models.LORA_TARGETS)
    cl.checkpoint.load_sharded(checkpoint, reference)
    adapters = {n: p.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}
    loaded = PeftModel.from_pretrained(M.load_weights(base, torch.bfloat16), out / "adapter").state_dict()
    assert adapters and all(torch.equal(t, loaded[n]) for n, t in adapters.items())
    merged, want = M.load_weights(out, dtype="auto"), reference.merge_and_unload()
    assert tensor_names(out) == tensor_names(base)
    expected = want.state_dict()
    for name, t in merged.state_dict().items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, expected[name]), name
    batch = cl.models.random_batch(merged.config.vocab_size, 2, 12)
    with torch.no_grad():
        assert torch.equal(merged(input_ids=batch["input_ids"]).logits, want(input_ids=batch["input_ids"]).logits)

    export(lora / "checkpoint-000002", tmp_path / "step2")
    assert_same_export(tmp_path / "step2", lora / "final")
    export(lora / "checkpoint-000002", tmp_path / "adapter-only", "--no-merge")
    assert not list((tmp_path / "adapter-only").glob("*.safetensors"))
    assert_same_export(tmp_path / "adapter-only" / "adapter", lora / "final" / "adapter")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_deepspeed_checkpoint_exports_its_weights_and_the_runs_export(deepspeed_run, work, tmp_path):
    """An intermediate checkpoint's export holds its fp32 master weights (DeepSpeed's zero_to_fp32) in bf16: the whole
    model's, or LoRA's adapters; the last checkpoint's export is the run's own, file for file (ZeRO-3's in fp32: the
    engine's bf16 weights, not the fp32 masters)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    name, run = deepspeed_run
    checkpoint, out = run / "checkpoint-000001", tmp_path / "step1"
    export(checkpoint, out, "--dtype", "bf16")
    masters = {k: v.to(torch.bfloat16) for k, v in
               get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="state").items()}
    if name == "zero2-lora":  # the adapters alone: peft stores them without the adapter's name
        adapter = load_file(out / "adapter" / "adapter_model.safetensors")
        assert len(adapter) == len(masters) > 0
        assert all(torch.equal(adapter[k.replace(".default.", ".")], t) for k, t in masters.items())
    else:
        exported = M.load_weights(out, dtype="auto")
        reference = M.load_weights(work[1], dtype=torch.bfloat16)
        reference.load_state_dict(masters)
        for (key, a), b in zip(exported.state_dict().items(), reference.state_dict().values()):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b), key
        batch = cl.models.random_batch(exported.config.vocab_size, 2, 12)
        with torch.no_grad():
            want = reference(input_ids=batch["input_ids"]).logits
            assert torch.equal(exported(input_ids=batch["input_ids"]).logits, want)

    export(run / "checkpoint-000002", tmp_path / "step2")
    assert_same_export(tmp_path / "step2", run / "final")


def one_line_error(argv: list, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        sft.main(["export", *map(str, argv)])
    message = str(exit_.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    assert not capsys.readouterr().out.strip()
    return message


def test_bad_input_on_the_command_line_is_one_line_on_stderr(single, tmp_path):
    done = subprocess.run([sys.executable, "-m", "course_lib.recipes.sft", "export", str(single / "final"), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and not done.stdout
    assert done.stderr.splitlines() == [f"error: {single / 'final'} records no run config: not a checkpoint of this "
                                        f"recipe (an export: it holds the model already)"]
    assert not (tmp_path / "out").exists()


def test_bad_input_ends_in_one_line_and_writes_nothing(single, work, tmp_path, capsys):
    checkpoint, out = single / "checkpoint-000001", tmp_path / "out"
    (tmp_path / "empty").mkdir()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    (tmp_path / "a-file").write_text("mine")
    cases = {
        "no checkpoint": ([tmp_path / "empty", "--out", out], "is not a checkpoint (no checkpoint.json)"),
        "the run's directory": ([single, "--out", out], "it holds checkpoints, the newest"),
        "the run's export": ([single / "final", "--out", out], "records no run config"),
        "a busy --out": ([checkpoint, "--out", tmp_path / "busy"], "is not empty and is no export of"),
        "--out a file": ([checkpoint, "--out", tmp_path / "a-file"], "is a file"),
        "--no-merge, full fine-tune": ([checkpoint, "--out", out, "--no-merge"], "--no-merge is for a LoRA run's"),
        "--dtype fp16": ([checkpoint, "--out", out, "--dtype", "fp16"], "invalid choice: 'fp16'"),
        "no --out": ([checkpoint], "required: --out"),
        "no such model": ([checkpoint, "--out", out, "--model-path", tmp_path / "nowhere"], "is not a directory"),
    }
    for name, (argv, expected) in cases.items():
        assert expected in one_line_error(argv, capsys), name
    assert not out.exists() and files(tmp_path / "busy") == ["notes.txt"]
    assert (tmp_path / "a-file").read_text() == "mine"

    truncated = tmp_path / "truncated"
    shutil.copytree(checkpoint, truncated)
    shard = sorted(truncated.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    assert f"{truncated} will not load onto" in one_line_error([truncated, "--out", out], capsys)
    assert not out.exists() and not list(tmp_path.glob("out.*"))


def test_a_moved_model_is_found_with_model_path_and_another_model_is_refused(single, work, tmp_path, capsys):
    """The checkpoint names the model where the run read it: gone from there, the command says so, and --model-path
    finds it where it is now; a model that is not the run's (its fingerprint) is refused."""
    from safetensors.torch import load_file, save_file

    moved, checkpoint = tmp_path / "moved-model", tmp_path / "checkpoint-000001"
    shutil.copytree(single / "checkpoint-000001", checkpoint)
    record = read_json(checkpoint / cl.checkpoint.MARKER)
    record["config"]["model_path"] = str(tmp_path / "models" / "gone")
    (checkpoint / cl.checkpoint.MARKER).write_text(json.dumps(record))
    assert "pass --model-path where it is now" in one_line_error([checkpoint, "--out", tmp_path / "out"], capsys)
    shutil.copytree(work[1], moved)
    export(checkpoint, tmp_path / "out", "--model-path", moved)
    assert f"model {moved}); wrote {tmp_path / 'out'}" in capsys.readouterr().out
    assert_export_is_the_checkpoint(tmp_path / "out", work[1], single / "checkpoint-000001")

    other = tmp_path / "another-model"
    shutil.copytree(work[1], other)
    weights = load_file(other / "model.safetensors")
    name = sorted(weights)[0]
    save_file({**weights, name: weights[name] + 1}, other / "model.safetensors", metadata={"format": "pt"})
    message = one_line_error([checkpoint, "--out", tmp_path / "out2", "--model-path", other], capsys)
    assert "is not the model the run trained" in message and not (tmp_path / "out2").exists()
