"""Chapter 11's grid (course_lib/sft/capstone.py, run by course_lib/recipes/capstone.py) and the report's front
page: each configuration's config, the ranking rule, saved-activation counting, resumable results, one short
2-rank launch."""
import json
import math
import os
from pathlib import Path

import pytest
import torch

import course_lib as cl
from course_lib.sft import data as D
from course_lib.sft import capstone
from course_lib.workbook import report
from course_lib.sft import model_dir as T
from course_lib.config import ConfigError
from course_lib.recipes import capstone as recipe

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("capstone")
    train, _ = D.make_examples(n_train=64, n_eval=2)
    base = T.make_tiny_checkpoint(root / "base", D.chat_corpus(train), TINY, vocab_size=300)
    D.write_task(root / "data", n_train=64, n_eval=2)
    common = recipe.Config(model_path=str(base), data_dir=str(root / "data"), out_dir="", steps=2, micro_batch=4,
                           seq_len=32, pack=True, precision="fp32", threads=1, lora_r=4)
    return root, common


def test_each_configuration_is_a_variant_of_the_sft_config():
    common = recipe.Config(model_path="m", data_dir="d", out_dir="o", micro_batch=8, precision="fp32")
    assert capstone.variant_config("ckpt", common, 4).act_ckpt
    accum = capstone.variant_config("accum", common, 4)
    assert (accum.micro_batch, accum.accum) == (2, 4)  # same tokens per step
    assert capstone.variant_config("bf16", common, 4).precision == "bf16"  # the row sets its own precision
    assert capstone.variant_config("zero3_offload", common, 4).deepspeed == "zero3_offload"
    lora = capstone.variant_config("lora", common, 4)
    assert lora.lora and lora.lora_alpha == 2 * lora.lora_r and lora.lora_dropout == 0.0
    assert not lora.export and lora.eval_n == 0 and lora.out_dir == "o/runs/lora"  # measuring only
    with pytest.raises(ValueError, match="multiple of --accum-split 3"):
        capstone.variant_config("accum", common, 3)
    assert all(c.ref in (None, "base", *capstone.GRID) for c in capstone.GRID.values())


def test_the_grid_takes_every_sft_flag_and_its_own():
    cfg = recipe.Config.parse(["--model-path", "m", "--data-dir", "d", "--out-dir", "o", "--configs", "accum",
                               "--accum", "2", "--steps", "3", "--accum-split", "2"])
    assert (cfg.accum, cfg.steps, cfg.accum_split, cfg.names()) == (2, 3, 2, ["accum"])
    with pytest.raises(SystemExit):
        recipe.Config.parse(["--model-path", "m", "--data-dir", "d", "--out-dir", "o", "--configs", "zero9"])


def test_ranking_puts_savings_without_slowdown_first_then_trades_then_speed():
    """Kinds by verdict (ranges that do not overlap), never by medians alone; within a kind, least memory first."""
    around = lambda t: [t * 0.98, t, t * 1.02]  # noqa: E731  a row's seconds per token over its steps, ±2%
    rows = {
        "base": {"ref": None, "device": 100, "time": around(10.0)},
        "ckpt": {"ref": "base", "device": 40, "time": around(14.0)},    # trade: less memory, measured slower
        "accum": {"ref": "base", "device": 60, "time": around(20.0)},   # trade, less saved: after ckpt
        "bf16": {"ref": "base", "device": 80, "time": around(3.0)},     # no slowdown measured (faster)
        "ddp": {"ref": "base", "device": 100, "time": around(5.0)},     # speed only
        "slow": {"ref": "base", "device": 100, "time": around(10.5)},   # neither: no less memory, slower
        "noisy": {"ref": "base", "device": 90, "time": [9.0, 10.5, 12.0]},  # median slower, ranges overlap
        "oom": {"ref": "base", "device": 10, "time": None},            # did not run: not ranked
    }
    ranked = capstone.ranking(rows)
    assert [r["config"] for r in ranked] == ["bf16", "noisy", "ckpt", "accum", "ddp", "slow"]
    assert [r["kind"] for r in ranked] == [capstone.NO_SLOWDOWN] * 2 + ["trade", "trade", "speed only", "neither"]
    assert [r["verdict"] for r in ranked] == ["faster", "indistinguishable", "slower", "slower", "faster", "slower"]
    assert ranked[2]["memory"] == pytest.approx(0.4) and ranked[2]["speed"] == pytest.approx(10 / 14)
    assert "indistinguishable here" in ranked[1]["comparison"] and "slower than base" in ranked[2]["comparison"]


def test_time_per_token_leaves_the_first_step_out():
    spread = capstone.time_per_token({"seconds": [9.0, 1.0, 2.0, 1.5], "tokens": [100, 100, 100, 100]})
    assert spread.samples == [0.01, 0.015, 0.02] and spread.median == 0.015
    assert capstone.time_per_token({"seconds": [1.0], "tokens": [10]}).samples == [0.1]  # one step: that one
    assert capstone.time_per_token({"error": "out of memory"}) is None


def test_saved_activations_leave_parameters_out_wherever_they_live():
    model = cl.models.tiny_qwen2(**TINY, vocab_size=64, seed=0)
    batch = cl.models.random_batch(64, 2, 16)
    with cl.SavedTensors(model) as reference:
        model(**batch).loss
    with capstone.SavedActivations(model) as saved:
        model(**batch).loss
    assert saved.bytes == reference.bytes > 0
    # a parameter re-materialized at a new address during the forward (as FSDP2 and ZeRO-3 gather them)
    weight = model.lm_head.weight
    weight.data = weight.data.clone()
    with capstone.SavedActivations(model) as moved:
        model(**batch).loss
    assert moved.bytes == reference.bytes
    # under bf16 autocast the 16-bit copies of the weights are counted apart: they follow the model, not the batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with capstone.SavedActivations(model) as one:
            model(**batch).loss
        with capstone.SavedActivations(model) as two:
            model(**cl.models.random_batch(64, 4, 16)).loss
    assert model.config.tie_word_embeddings  # the embedding matrix is also the head: one linear more
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert one.copies == two.copies == pytest.approx(2 * matrices, rel=0.05)
    assert two.bytes == pytest.approx(2 * one.bytes, rel=0.05)  # twice the batch, twice the activations


def test_grid_measures_and_resumes(workspace, tmp_path):
    root, common = workspace
    common = cl.config.replace(common, out_dir=str(tmp_path))
    log = []
    first = recipe.run(cl.config.replace(common, configs="fp32,ckpt,lora"), log=log.append)
    psi = first["fp32"]["params"]
    fp32, ckpt, lora = (capstone.per_rank(first[n]) for n in ("fp32", "ckpt", "lora"))
    assert fp32["states"] == pytest.approx(16 * psi, rel=1e-3)  # fp32 weights + grads + AdamW moments
    assert ckpt["states"] == fp32["states"] and 0 < ckpt["saved"] < fp32["saved"]
    trainable = first["lora"]["trainable"]
    assert 0 < trainable < psi and lora["states"] == pytest.approx(4 * psi + 16 * trainable, rel=1e-3)
    assert all(math.isfinite(first[n]["tokens_per_s"]) and first[n]["fit"] for n in first)
    assert first["fp32"]["ranks"][0]["adamw_kernel"] in ("fused", "foreach", "for-loop")  # read from its optimizer
    stored = json.loads(capstone.result_path(tmp_path, "fp32").read_text())
    assert stored["signature"]["config"] == "fp32" and stored["tokens_per_s"] == first["fp32"]["tokens_per_s"]

    log.clear()
    again = recipe.run(cl.config.replace(common, configs="fp32,ckpt"), log=log.append)
    assert all("stored result reused" in line for line in log) and again["ckpt"] == first["ckpt"]
    changed = recipe.run(cl.config.replace(common, configs="fp32", lr=5e-4), log=log.append)  # another signature
    assert changed["fp32"]["signature"] != first["fp32"]["signature"]
    log.clear()
    recipe.run(cl.config.replace(common, configs="fp32", lr=5e-4, rerun=True), log=log.append)
    assert "reused" not in log[-1]
    sig = capstone.signature("fp32", capstone.variant_config("fp32", common, 4), 1)
    assert sig["files"]["config.json"] and sig["files"]["train.jsonl"]  # a rewritten model or task is measured anew


@pytest.mark.timeout(400)
def test_sharded_rows_in_one_launch(workspace, tmp_path):
    """DDP, ZeRO-3 and FSDP2 in one 2-rank launch (the fast tier's check of the three backends): each rank holds 16Ψ,
    about 16Ψ/N and 16Ψ/N of model states, and all three take the same first step."""
    root, common = workspace
    cfg = cl.config.replace(common, configs="ddp,zero3,fsdp2", out_dir=str(tmp_path), threads=None)
    run = cl.launch(cfg, nproc=2, launcher="torchrun", timeout=360, env={"OMP_NUM_THREADS": "1"})
    res = run.result
    psi = res["fsdp2"]["params"]
    for r in res["ddp"]["ranks"]:  # every rank a whole replica: fp32 weights, gradients and AdamW's two moments
        assert r["states"]["total"] == pytest.approx(16 * psi, rel=0.01)
    for r in res["fsdp2"]["ranks"]:
        assert r["states"]["total"] == pytest.approx(16 * psi / 2, rel=0.01)
    for r in res["zero3"]["ranks"]:  # fp32: (4 + 4 + 8)Ψ/N (the fp32 partition is its own master: counted once),
        print(r["states"], 16 * psi / 2)  # plus the tiny model's unpartitioned small tensors and a gradient bucket
        assert r["states"]["optimizer"] == pytest.approx(8 * psi / 2, rel=0.02)  # in flight, both large at this size
        assert 16 * psi / 2 <= r["states"]["total"] < 0.75 * 16 * psi  # well under what one replica holds
        assert max(r["saved_per_micro"]) > 0
    for name in ("zero3", "fsdp2"):  # one model, data and order: the backends agree on the loss
        assert res[name]["loss"][0] == pytest.approx(res["ddp"]["loss"][0], rel=1e-4), name
    for name in ("ddp", "zero3", "fsdp2"):  # each row records the AdamW kernel it stepped with (chapter 11 prints it)
        assert all(r["adamw_kernel"] in ("fused", "foreach", "for-loop") for r in res[name]["ranks"]), name


def test_report_front_page(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "runs.json").write_text(json.dumps({
        "03_x": {"notebook": "03_x", "status": "ok", "seconds": 12.0, "profile": "cpu"},
        "11_capstone_methodology": {"notebook": "11_capstone_methodology", "status": "failed", "seconds": 3.0,
                                    "profile": "cpu", "error": "In [4]: AssertionError: boom"}}))
    ledger = {"notebook": "03_x", "profile": "cpu", "device": "cpu", "metrics": {
        "held": {"value": 1.0, "unit": "", "expect": "1 (exact)", "ok": True},
        "broken": {"value": 2.0, "unit": "B", "expect": "1 (exact)", "ok": False, "note": "why it matters"}}}
    (tmp_path / "results" / "03_x.json").write_text(json.dumps(ledger))
    (tmp_path / "capstone").mkdir()
    (tmp_path / "capstone" / "summary.json").write_text(json.dumps({
        "schema": capstone.SUMMARY_SCHEMA, "profile": "cpu", "device": "cpu", "cpu": "x86_64", "bf16_native": False, "base": "fp32", "ranks": 2,
        "params": 1000, "unit": "MiB", "budget": 2**20, "budget_note": "made up",
        "rows": [{"config": "fp32", "label": "fp32 baseline", "precision": "fp32", "ranks": 1, "states": 2**21, "copies": 0,
                  "host": 0, "saved": 2**20, "device": 3 * 2**20, "tokens_per_s": 500.0, "fit": False},
                 {"config": "ddp", "label": "DDP", "precision": "fp32", "ranks": 2, "states": 2**21, "copies": 0,
                  "host": 0, "saved": 2**20, "device": 3 * 2**20, "tokens_per_s": 900.0, "fit": True, "unit": "GiB"}],
        "ranking": [{"config": "ckpt", "ref": "fp32", "memory": 0.5, "speed": 0.8, "kind": "trade"}],
        "fastest_that_fits": "ckpt", "compare": [{"what": "ckpt memory", "source": "TF §6", "theirs": 0.58, "ours": 0.5}]}))
    page = report.write_report(tmp_path).read_text()
    assert "1 ok</span>" in page and "1 failed</span>" in page and "not run" in page  # every notebook listed
    assert "claims held: <b>1 / 2</b>" in page
    assert "Claims that did not hold" in page and "broken" in page and "why it matters" in page
    assert "Capstone: what to turn on first" in page and "fp32 baseline" in page and "<b>ckpt</b> (trade)" in page
    assert page.index("Capstone") < page.index("<h2>Chapters</h2>")  # the front page comes first
    assert "AssertionError: boom" in page
    assert ">3.00</td>" in page and ">0.00 GiB</td>" in page  # a row in another unit (one GPU's CPU ranks) says so


def test_a_configuration_that_cannot_run_is_recorded_not_fatal(workspace, tmp_path):
    root, common = workspace
    with pytest.raises(ConfigError, match="no DeepSpeed config 'no_such_config'"):  # a name: refused before any row
        cl.config.replace(common, configs="fp32", deepspeed="no_such_config", out_dir=str(tmp_path))
    stage_9 = tmp_path / "stage_9.json"  # a config that reads but cannot run: its row fails, the grid goes on
    stage_9.write_text(json.dumps({"zero_optimization": {"stage": 9}}))
    cfg = cl.config.replace(common, configs="fp32", deepspeed=str(stage_9), out_dir=str(tmp_path))
    res = recipe.run(cfg, log=lambda _: None)["fp32"]
    assert res["fit"] is False and res["error"].startswith("ZeroConfigError: zero_optimization.stage must be 0, 1, 2 or 3")
    assert capstone.per_rank(res)["states"] == 0 and "tokens_per_s" not in res


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_one_gpu_runs_the_distributed_rows_as_cpu_ranks_against_a_reference_of_their_sizes(monkeypatch, tmp_path):
    """Chapter 11 on one GPU: `ranks_plan` sends the distributed rows to 2 CPU gloo ranks at the cpu
    profile's sizes, `rank_reference` measures their one-process reference at those sizes in this process with the
    GPUs hidden (`cl.env.cpu_only`), and DDP launched under the plan holds what that reference holds. The plan is
    made on a pretend one-GPU machine; what it plans then runs for real here, on the CPU, as it would beside a GPU."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with monkeypatch.context() as pretend:  # torch.cuda's two questions answered as on one GPU; no device is touched
        pretend.setattr(torch.cuda, "is_available", lambda: True)
        pretend.setattr(torch.cuda, "device_count", lambda: 1)
        P = cl.preset("gpu", chapter="11")
        plan = cl.presets.ranks_plan(P)
        with cl.env.cpu_only():
            assert cl.pick_device().type == "cpu"
        assert cl.pick_device().type == "cuda" and "CUDA_VISIBLE_DEVICES" not in os.environ  # restored
    assert plan.P is not P and (plan.nproc, plan.device, plan.env) == (2, "cpu", {"CUDA_VISIBLE_DEVICES": ""})

    threads = torch.get_num_threads()
    rank_cfg, measured = recipe.rank_reference(plan.P, tmp_path / "ranks")
    ref = capstone.RANK_BASE
    assert set(measured) == {ref} and torch.get_num_threads() == threads
    assert rank_cfg.precision == capstone.RANK_PRECISION == "fp32"  # the ranks' rows change the sharding only
    assert json.loads((Path(rank_cfg.model_path) / "config.json").read_text())["hidden_size"] == \
        plan.P.sft_model["hidden_size"] < P.sft_model["hidden_size"]
    assert (rank_cfg.steps, rank_cfg.out_dir) == (plan.P.steps, str(tmp_path / "ranks"))
    assert measured[ref]["precision"] == rank_cfg.precision and measured[ref]["world_size"] == 1
    assert capstone.variant(ref).label and not capstone.variant(ref).distributed

    job = cl.launch(cl.config.replace(rank_cfg, configs="ddp"), nproc=plan.nproc, launcher="torchrun", timeout=360,
                    env=plan.env, wait=False)  # as the chapter does: in the background, beside the GPU's rows
    run = job.wait()
    ddp, one = capstone.per_rank(run.result["ddp"]), capstone.per_rank(measured[ref])
    assert run.result["ddp"]["world_size"] == 2 and ddp["states"] == one["states"]  # DDP replicates: no saving
    assert ddp["saved"] == pytest.approx(one["saved"], rel=1e-3)  # the same micro-batch per rank


def test_the_base_precision_is_the_faster_row_unless_one_is_asked_for():
    rows = {"fp32": {"tokens_per_s": 900.0}, "bf16": {"tokens_per_s": 1100.0}, "ckpt": {"tokens_per_s": 5000.0}}
    assert capstone.faster_precision(rows) == "bf16" and capstone.faster_precision(rows, "fp32") == "fp32"
    assert capstone.faster_precision({"fp32": {"tokens_per_s": None}}) == "fp32" == capstone.faster_precision({})
