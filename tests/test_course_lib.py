"""Unit tests of course_lib's core: memory theory, measurement, ledger, presets, runner input."""
import json

import pytest
import torch

import course_lib as cl
from course_lib import memory
from course_lib.workbook import runner
from course_lib.workbook.widgets import plan_for, total_label


def test_zero_formulas_match_the_paper():
    psi, n = 7.5e9, 64
    totals = [memory.zero_state_bytes(psi, stage, n)["total"] / memory.GB for stage in range(4)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    assert memory.zero_state_bytes(psi, 2, 1)["total"] == memory.zero_state_bytes(psi, 0, 1)["total"]


def test_bytes_per_param():
    assert sum(memory.state_bytes_per_param("fp32", "adamw").values()) == 16
    assert sum(memory.state_bytes_per_param("bf16-mixed", "adamw").values()) == 16
    assert sum(memory.state_bytes_per_param("bf16-mixed", "sgd").values()) == 8


def test_activation_formula_on_the_papers_gpt3_layer():
    # Korthikanti et al.'s GPT-3 175B layer: s = 2048, b = 1, h = 12288, a = 96, so 5as/h = 80 and a layer keeps
    # 2048 x 12288 x (34 + 80) bytes; by hand: 25,165,824 x 114 = 2,868,903,936 (selective: x 34; full: x 2).
    s, b, h, a = 2048, 1, 12288, 96
    assert memory.activation_bytes_per_layer(s, b, h, a) == 2_868_903_936
    assert memory.activation_bytes_per_layer(s, b, h, a, "selective") == 855_638_016
    assert memory.activation_bytes_per_layer(s, b, h, a, "full") == 50_331_648


def test_count_params_matches_transformers():
    model = cl.models.tiny_qwen2(num_hidden_layers=2, tie_word_embeddings=False)
    assert memory.count_params(model.config) == sum(p.numel() for p in model.parameters())
    assert round(memory.count_params(cl.models.QWEN25["Qwen2.5-7B"]) / 1e9, 2) == 7.62


@pytest.mark.parametrize("kwargs, word", [
    (dict(zero_stage=4), "ZeRO stage"), (dict(ranks=-2), "ranks"), (dict(ranks=0), "ranks"),
    (dict(precision="fp8"), "precision"), (dict(seq=0), "seq"),
])
def test_calculator_refuses_bad_input_with_one_line(kwargs, word):
    with pytest.raises(ValueError, match=word) as err:
        plan_for("Qwen2.5-7B", **kwargs)
    assert "\n" not in str(err.value)


def test_calculator_shows_the_one_memory_model():
    # Qwen2.5-0.5B, bf16 weights and gradients + fp32 master and moments, ZeRO-3 over 8 GPUs: 16 bytes a parameter
    # sharded 8 ways, by hand 16 x 494,032,768 / 8 = 988,065,536 B of model states per GPU
    plan = plan_for("Qwen2.5-0.5B", zero_stage=3, ranks=8)
    assert plan["params"] + plan["grads"] + plan["optimizer"] == 988_065_536
    assert total_label(plan) == f"per GPU: peak {plan['peak'] / 1e9:.2f} GB" and plan["peak"] > plan["total"] - plan["logits"]
    for setup in (dict(), dict(zero_stage=2, ranks=4, checkpointing=True), dict(precision="fp32", ranks=8)):
        backend = {0: "single"}.get(setup.get("zero_stage", 0), f"zero{setup.get('zero_stage')}")
        backend = "ddp" if backend == "single" and setup.get("ranks", 1) > 1 else backend
        direct = memory.step_memory(cl.models.QWEN25["Qwen2.5-7B"], backend=backend, ranks=setup.get("ranks", 1),
                                    precision=setup.get("precision", "bf16-mixed"),
                                    checkpointing=setup.get("checkpointing", False))
        assert plan_for("Qwen2.5-7B", **setup)["peak"] == direct["peak"], setup  # the widget is the model


def test_qwen25_7b_activations_follow_the_validated_count():
    # s = 2048, b = 1, bf16: 28 layers x 2048 tokens x 2 bytes x (6h + 2q + 2kv + h + 4I) values with h = q = 3584,
    # kv = 512, I = 18944, i.e. 109,056 values: by hand 12,507,414,528 B; plus the final norm's two fp32 values of
    # width h a token, 58,720,256 B
    plan = memory.step_memory(cl.models.QWEN25["Qwen2.5-7B"], precision="bf16-mixed", seq=2048)
    assert plan["activations"] == 13_329_498_112 + 58_720_256
    assert plan["logits"] == 2048 * 152064 * 4  # fp32 log-probabilities of every position
    assert 13e9 < plan["activations"] + plan["logits"] < 15e9  # "about 14 GB", not the GPT constant's 7


def test_model_state_bytes_after_adamw_step():
    model = torch.nn.Linear(10, 5)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    held = cl.model_state_bytes(model, opt)
    assert held == {"params": 220, "grads": 220, "optimizer": 440 + 8, "total": 888}


def test_saved_tensors_counts_shared_storage_once_and_skips_weights():
    lin = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    with cl.SavedTensors(lin) as saved:
        y = lin(x)
        z = (y * y).sum()  # saves y twice (one storage)
    assert saved.bytes == x.nbytes + y.nbytes
    z.backward()


def test_ledger_records_and_checks(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path))
    monkeypatch.delenv("COURSE_RECORD_ONLY", raising=False)
    ledger = cl.Ledger("99_test", profile="cpu")
    ledger.record("bare", 1.5, "s")
    ledger.check("exact", 16, "B", expect=16)
    ledger.check("range", 0.7, "x", expect=(0.6, None))
    with pytest.raises(AssertionError, match="far"):
        ledger.check("far", 2.0, "x", expect=1.0, rel=0.1)
    with pytest.raises(TypeError):
        ledger.record("with_expect", 1.0, "s", expect=1.0)  # an expectation makes it an observation or a claim
    data = json.loads((tmp_path / "results" / "99_test.json").read_text())
    assert data["profile"] == "cpu"
    assert data["metrics"]["bare"] == {"value": 1.5, "unit": "s", "kind": "record", "expect": None, "ok": None}
    assert data["metrics"]["exact"]["ok"] is True and data["metrics"]["far"]["ok"] is False
    assert data["metrics"]["exact"]["kind"] == data["metrics"]["far"]["kind"] == "claim"
    assert data["metrics"]["range"]["expect"] == "[0.6, inf]"


def test_an_observation_is_shown_beside_its_prediction_and_never_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path))
    ledger = cl.Ledger("99_test", profile="cpu")
    ledger.observe("comm_seconds", 0.078, "s", predict=0.013, note="α+β of the calls timed alone")
    assert "seen comm_seconds = 0.078 s  (predicted 0.013 (measured/predicted 6.00))" in capsys.readouterr().out
    m = json.loads((tmp_path / "results" / "99_test.json").read_text())["metrics"]["comm_seconds"]
    assert m["kind"] == "observation" and m["ok"] is None and m["predicted"] == 0.013
    assert m["ratio"] == pytest.approx(6.0) and "expect" not in m
    assert cl.results.failed_claims({"comm_seconds": m}) == {} and cl.results.claim_outcomes({"comm_seconds": m}) == []


def test_a_quiet_ledger_writes_its_rows_and_shows_none(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path))
    quiet = cl.Ledger("bench_tiny_single", profile="cpu", quiet=True)
    quiet.check("held", 1.0, "x", expect=1.0)
    quiet.observe("seen", 2.0, "x", predict=1.0)
    assert capsys.readouterr().out == "" and quiet._tables is None
    assert set(json.loads((tmp_path / "results" / "bench_tiny_single.json").read_text())["metrics"]) == {"held", "seen"}


def test_record_mode_keeps_a_missed_claim_and_the_report_lists_it_apart(tmp_path, monkeypatch, capsys):
    from course_lib.workbook import report

    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("COURSE_RECORD_ONLY", "1")
    ledger = cl.Ledger("99_test", profile="cpu")
    ledger.check("far", 2.0, "x", expect=1.0, rel=0.1)  # not raised
    ledger.check("near", 1.0, "x", expect=1.0)
    ledger.observe("slow", 5.0, "s", predict=1.0)
    assert "MISS far = 2 x  (expected 1 (±0.1 rel))" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "results" / "99_test.json").read_text())["metrics"]
    assert metrics["far"]["ok"] is False and metrics["far"]["status"] == "recorded"
    assert list(cl.results.failed_claims(metrics)) == ["far"]
    page = report.render(tmp_path, book="")
    recorded = page.split("Claims recorded, not held")[1].split("</table>")[0]
    assert "far" in recorded and "slow" not in recorded and "Claims that did not hold" not in page
    assert "claims held: <b>1 / 2</b>" in page and "observed ×5" in page
    monkeypatch.setenv("COURSE_RECORD_ONLY", "0")
    with pytest.raises(AssertionError):
        ledger.check("far", 2.0, "x", expect=1.0, rel=0.1)
    assert "Claims that did not hold" in report.render(tmp_path, book="")


def test_presets_are_plain_data_and_refuse_unknowns():
    p = cl.preset("cpu", chapter="00", act_batch=None)
    assert p.name == "cpu" and p.act_batch == cl.presets.PRESETS["cpu"]["chapters"]["00"]["act_batch"]
    assert cl.preset("cpu", chapter="00", act_batch=2).act_batch == 2
    with pytest.raises(ValueError, match="unknown profile 'tpu'"):
        cl.preset("tpu")
    with pytest.raises(ValueError, match="unknown knob 'stpes'"):
        cl.preset("cpu", stpes=3)



def test_the_memory_model_counts_what_an_instrument_adds_only_when_asked():
    """Training holds the tied weight's two ZeRO-3 gradients; a dispatch mode watching makes their sum out of place,
    one embedding more (`watched=True`, for the comparison with cl.LiveTensorBytes); nothing else changes."""
    q = cl.models.QWEN25["Qwen2.5-0.5B"]
    for backend, ranks in (("single", 1), ("ddp", 2), ("fsdp2", 2), ("zero2", 2), ("zero3", 2)):
        plain, watched = (memory.step_memory(q, backend=backend, ranks=ranks, precision="bf16-mixed", seq=128,
                                             watched=w)["phases"]["backward"] for w in (False, True))
        assert watched - plain == (q["vocab_size"] * q["hidden_size"] * 4 if backend == "zero3" else 0), backend


def _process_state() -> tuple:
    """What `preset` must not touch: the environment, torch's TF32 flags, and every global of every course_lib
    module loaded (by identity, and by value where it is plain data a call could change in place)."""
    import copy
    import os
    import sys

    def plain(value) -> bool:  # data all the way down (a dict of models, e.g. a cache, is compared by identity)
        if isinstance(value, (str, int, float, bool, type(None))):
            return True
        if isinstance(value, dict):
            return all(plain(k) and plain(v) for k, v in value.items())
        return isinstance(value, (list, tuple, set)) and all(plain(v) for v in value)

    names = {}
    for module_name, module in list(sys.modules.items()):
        if module_name == "course_lib" or module_name.startswith("course_lib."):
            for key, value in vars(module).items():
                if not key.startswith("__"):
                    names[module_name, key] = (id(value), copy.deepcopy(value) if plain(value) else None)
    return dict(os.environ), (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32), names


def test_preset_changes_nothing_and_setup_is_what_prepares_the_kernel(monkeypatch):
    import course_lib.parallel.zero, course_lib.sft.backends, course_lib.workbook.runner  # noqa: E401,F401  (globals)
    before = _process_state()
    for profile in cl.presets.PRESETS:
        for chapter in [None, *cl.presets.PRESETS[profile]["chapters"]]:
            cl.preset(profile, chapter=chapter)
    after = _process_state()
    assert after[0] == before[0] and after[1] == before[1]
    assert {k for k in before[2] if before[2][k] != after[2].get(k)} == set()
    # the calls that do change the kernel are setup's, and this test sees them (restored after by monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("KEEP_LAST_BUILT", "INIT_DEVICE"):
        monkeypatch.setattr(cl.models, name, getattr(cl.models, name))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    cl.setup(cl.preset("cpu"))
    assert _process_state()[0]["CUDA_VISIBLE_DEVICES"] == ""
    gpu = cl.preset("gpu", chapter="03")
    cl.setup(gpu)
    assert torch.backends.cuda.matmul.allow_tf32 is bool(gpu.tf32) and cl.models.KEEP_LAST_BUILT is True
    changed = {k for k in before[2] if before[2][k] != _process_state()[2].get(k)}
    assert changed == {("course_lib.models", "KEEP_LAST_BUILT"), ("course_lib.models", "INIT_DEVICE")}

def test_runner_refuses_unknown_profile_and_notebook(capsys):
    assert runner.main(["--profile", "tpu"]) == 2
    assert "unknown profile 'tpu'" in capsys.readouterr().err
    assert runner.main(["--profile", "cpu", "--only", "99"]) == 2
    assert "no notebook matches ONLY='99'" in capsys.readouterr().err


def test_runner_reports_a_failing_cell_briefly(tmp_path, monkeypatch):
    """...and the executed notebook in out/ stays the earlier run's, whole, while the chapter runs (the book or a
    second runner may read it then); the new one replaces it when the chapter ends."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("profile = 'cpu'", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("import json\nx = json.load(open('out/98_failing.ipynb'))['metadata']['earlier']"),
        nbformat.v4.new_code_cell("assert x == 2, 'x is not two'"),
    ])
    nb.metadata["kernelspec"] = {"name": "llm-course", "display_name": "Python (LLM course)", "language": "python"}
    path = tmp_path / "98_failing.ipynb"
    nbformat.write(nb, path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / path.name).write_text(json.dumps({"metadata": {"earlier": 1}}))  # an earlier run's
    outcome = runner.execute(path, "cpu", tmp_path / "out")
    assert outcome.status == "failed"
    # papermill injects the profile as a cell of its own: the failing cell is In [4] of the executed copy
    assert outcome.error.startswith(f"In [4] of {tmp_path / 'out' / path.name}: AssertionError: x is not two")
    assert len(outcome.error.splitlines()) < 12
    assert "papermill-error-cell" in (tmp_path / "out" / path.name).read_text()  # the new run's, whole
    assert not list((tmp_path / "running").iterdir())


def test_tiny_qwen2_built_again_is_a_copy_with_the_same_weights_and_rng(monkeypatch):
    """A chapter builds its model many times (a 0.5B random init is ~10 s on a CPU): with KEEP_LAST_BUILT
    (the gpu preset's) the second build is a deep copy of the first, equal to a fresh build, untouched by changes to
    the first, and leaves the RNG as a fresh build does. Off by default (the cpu world keeps no hidden copy)."""
    from transformers import Qwen2ForCausalLM

    assert not cl.models.KEEP_LAST_BUILT
    monkeypatch.setattr(cl.models, "KEEP_LAST_BUILT", True)
    first = cl.models.tiny_qwen2(seed=3)
    after_first = torch.rand(3)
    with torch.no_grad():
        first.model.embed_tokens.weight.add_(1.0)
    again = cl.models.tiny_qwen2(seed=3)
    assert torch.equal(torch.rand(3), after_first)
    assert again.lm_head.weight is again.model.embed_tokens.weight  # tied, as built
    torch.manual_seed(3)
    fresh = Qwen2ForCausalLM(cl.models.qwen2_config())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), again.state_dict().values()))
    assert not torch.equal(cl.models.tiny_qwen2(seed=4).model.embed_tokens.weight, again.model.embed_tokens.weight)


@pytest.mark.parametrize("dtype, nbytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_qwen2_activation_count_holds_in_fp32_and_in_a_16bit_model(dtype, nbytes):
    """Chapter 00's count within 5% of what autograd saves, in fp32 (the CPU profile) and for a bf16 model (the GPU
    profile measures in bf16, where SDPA has a fused kernel for grouped-query heads)."""
    model = cl.models.tiny_qwen2(dtype=dtype)
    x = cl.models.random_batch(model.config.vocab_size, 2, 128, seed=1)
    with cl.SavedTensors(model) as saved:
        model(**x).loss
    count = cl.memory.qwen2_activation_bytes(model.config, 128, 2, bytes_per_value=nbytes)
    assert saved.bytes / count == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("shape", [{}, dict(hidden_size=224, num_attention_heads=14, num_key_value_heads=2)])
def test_qwen2_activation_count_knows_the_math_attention_kernel(shape):
    """What a GPU does in fp32 with grouped-query heads (SDPA falls back to its math kernel, which keeps the
    probabilities), done here by forcing that kernel: the count with attention="MATH" holds within 5%, and its extra
    over the fused kernel's within 2%. This CPU's own kernel, asked of torch, is a fused one in both dtypes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = cl.models.tiny_qwen2(**shape)
    x = cl.models.random_batch(model.config.vocab_size, 2, 96, seed=1)
    saved = {}
    for kernel in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        with sdpa_kernel([kernel]), cl.SavedTensors(model) as s:
            model(**x).loss
        saved[kernel.name] = s.bytes
    count = {k: cl.memory.qwen2_activation_bytes(model.config, 96, 2, attention=k) for k in saved}
    assert saved["MATH"] / count["MATH"] == pytest.approx(1.0, rel=0.05)
    assert (saved["MATH"] - saved["FLASH_ATTENTION"]) / (count["MATH"] - count["FLASH_ATTENTION"]) == pytest.approx(1.0, rel=0.02)
    assert {cl.models.attention_kernel(model.config, "cpu", d) for d in (torch.float32, torch.bfloat16)} == {"FLASH_ATTENTION"}


def test_run_phases_set_an_instruments_stretch_apart():
    """`RunPhases.apart` (chapter 10's recipe under --memory-trace): the watched stretch's own high-water mark is
    its phase; the figures after it, and the run's peak, leave it out (the mark starts again, Linux)."""
    import time

    from course_lib.memory.measure import RunPhases, reset_peak_rss

    if not reset_peak_rss():
        pytest.skip("this system cannot reset a process's high-water resident memory")
    held = 2**28  # 256 MiB, written: resident
    phases = RunPhases(time.perf_counter())
    phases.done("start")
    with phases.apart("not watched", when=False):
        torch.ones(held // 4)
    phases.done("unwatched step")
    assert phases.rss["unwatched step"] >= phases.rss["start"] + 0.9 * held and "not watched" not in phases.rss
    with phases.apart("watched step"):
        torch.ones(2 * held // 4)
    phases.done("after")
    assert phases.rss["watched step"] >= phases.rss["start"] + 1.9 * held
    assert phases.rss["unwatched step"] <= phases.rss["after"] == phases.peak() < phases.rss["watched step"] - 0.5 * held
    assert list(phases.seconds) == ["start", "unwatched step", "watched step", "after"]


def test_busy_core_keeps_a_spinning_process_only_for_the_block():
    import psutil

    from course_lib.workbook import runner

    with runner.busy_core() as spin:
        assert spin.poll() is None
        assert psutil.Process(spin.pid).cpu_percent(interval=0.5) > 20  # it spins (shared cores: not a full core)
    assert spin.poll() is not None and not psutil.pid_exists(spin.pid)  # killed and reaped when the block ends
