"""The GPU code paths, checked on the CPU: inputs that follow the model's device (the `meta` device
stands in for a GPU), collectives on the group's device, tensor-parallel degrees that split the heads, a bounded
pipeline reference, groups of one, profiler shares counted once, DeepSpeed's host tier by its own rule, the cpu
profile hiding the GPUs, synchronizing timers, deterministic resumes."""
import ast
import os
import re
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import course_lib as cl
from course_lib import env, timing
from course_lib.workbook import runner
from course_lib.parallel import tensor_parallel as tpl
from course_lib.models import QWEN25, TINY
from course_lib.paths import REPO_ROOT

Q05 = QWEN25["Qwen2.5-0.5B"]


@pytest.fixture
def group_of_one(monkeypatch):
    """A one-rank gloo group in this process, gone after the test."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    ctx = cl.dist.init(group_of_one=True)
    yield ctx
    if dist.is_initialized():
        dist.destroy_process_group()


# --- 1. chapter 08 -------------------------------------------------------------------------------------------
def test_tp_parts_build_their_inputs_on_the_model_device(monkeypatch):
    """On the `meta` device any tensor the parts made on the CPU instead would fail ("expected device meta")."""
    from course_lib.recipes import tp

    monkeypatch.setattr(tp, "max_diff", lambda a, b: 0.0)  # .item() has no value on meta
    args = tp.Config.from_preset(cl.preset("cpu", chapter="08"), global_batch=2, seq_len=8)
    ctx = SimpleNamespace(device=torch.device("meta"), rank=0, world_size=1)
    out = tp.linear_checks(ctx, args, None)
    assert out["column_weight_shape"] == [4 * args.hidden_size, args.hidden_size]
    model = cl.models.tiny_qwen2(**args.size()).to("meta")
    assert tp.block_checks(ctx, args, model, None)["mlp_param_bytes_rank"] > 0


def test_parallel_linear_shards_live_where_the_full_layer_lives():
    full = torch.nn.Linear(8, 16, device="meta")
    assert tpl.ColumnParallelLinear.from_linear(full).weight.device.type == "meta"
    assert tpl.RowParallelLinear.from_linear(full).weight.device.type == "meta"


def test_tp_degrees_split_the_heads_and_the_default_meshes_use_them():
    assert tpl.tp_degrees(Q05) == [1, 2]  # 14 query heads, 2 key/value heads
    assert tpl.default_meshes(8, Q05) == ["4x2", "8x1"]
    assert tpl.default_meshes(4, Q05) == ["2x2", "4x1"]
    assert tpl.default_meshes(1, Q05) == ["1x1"]
    assert tpl.default_meshes(2, TINY) == ["1x2", "2x1"]  # the cpu profile's meshes, unchanged


def test_tp_recipe_refuses_a_degree_that_does_not_split_the_heads():
    from course_lib.recipes import tp

    with pytest.raises(SystemExit, match=r"do not split over 4 ranks; tensor-parallel degrees that do: \[1, 2\]"):
        tp.make_mesh(SimpleNamespace(world_size=4), "1x4", Q05)


def test_pp_reference_runs_one_micro_batch_at_a_time(group_of_one):
    from course_lib.parallel import pipeline_parallel as ppl
    from course_lib.recipes import pp

    args = pp.Config.from_preset(cl.preset("cpu", chapter="08"), micro_batch=2, seq_len=16)
    model = cl.models.tiny_qwen2(**args.size())
    module = ppl.qwen2_stage(model, 0, 1)
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    batch = cl.models.random_batch(args.vocab_size, 4 * args.micro_batch, args.seq_len)
    out = pp.equivalence(group_of_one, args, model, module, batch, m=4)
    assert seen == [args.micro_batch] * 4  # never the whole batch's logits at once
    assert out["logits_max_diff"] < 1e-5 and out["grad_max_diff"] < 1e-6
    assert out["loss"] == pytest.approx(out["loss_unsplit"], abs=1e-6)


# --- 2. collectives on the group's device -------------------------------------------------------------------
def test_collective_device_is_the_gpu_under_nccl(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert cl.dist.collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert cl.dist.collective_device() == torch.device("cpu")


def test_reductions_build_their_tensors_on_the_collective_device(monkeypatch):
    from course_lib.parallel import comm

    asked, reduced = [], []
    spy = lambda group=None: asked.append(group) or torch.device("cpu")  # noqa: E731
    monkeypatch.setattr(cl.dist, "collective_device", spy)
    monkeypatch.setattr(comm, "collective_device", spy)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: reduced.append(t.device))
    monkeypatch.setattr(comm, "time_collective", lambda *a, **kw: 1e-3)
    assert cl.dist.all_reduce_scalar(3.0, "max") == 3.0
    comm.sweep([1024, 4096], kinds=("all_reduce",), repeat=1)
    assert len(asked) == 2 and reduced == [torch.device("cpu")] * 2


# --- 3. groups of one; profiler shares ----------------------------------------------------------------------
WRAPS = ("apply_ddp(", "shard_model(", "zero.initialize(", "DistributedDataParallel", "DDP(", "fully_shard(",
         "deepspeed.initialize(")


# Recipes that wrap through course_lib/sft/backends.py, whose one-process behaviour a test runs instead: the SFT
# recipe (DeepSpeed in a group of one, FSDP2 refused in one line, else no wrapper); chapter 11's grid (several ranks).
WRAPS_THROUGH_BACKENDS = {
    "sft.py": "tests/test_sft_recipe.py::test_one_process_runs_deepspeed_in_a_group_of_one_and_refuses_fsdp_in_one_line",
    "capstone.py": "tests/test_capstone.py (launched on 2 ranks: it never runs alone)",
}


def test_every_recipe_that_wraps_a_model_inits_a_group_of_one():
    """DDP, FSDP2 and DeepSpeed need a process group even for one process: `cl.dist.init(group_of_one=True)`."""
    for path in sorted((REPO_ROOT / "course_lib" / "recipes").glob("*.py")):
        source = path.read_text()
        if re.search(r"^from course_lib\.sft import .*\bbackends\b", source, re.M):
            where = WRAPS_THROUGH_BACKENDS.get(path.name, "")
            test_file, _, name = where.partition("::")
            assert where and (REPO_ROOT / test_file.split(" ")[0]).is_file(), f"{path.name} wraps through backends"
            assert not name or f"def {name}(" in (REPO_ROOT / test_file).read_text(), where
            continue
        if not any(w in source for w in WRAPS):
            continue
        inits = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
                 and ast.unparse(n.func) in ("cl.dist.init", "dist.init")]
        assert inits, f"{path.name} wraps a model but never calls cl.dist.init"
        for call in inits:
            kw = {k.arg: ast.unparse(k.value) for k in call.keywords}
            assert kw.get("group_of_one") == "True", f"{path.name}: {ast.unparse(call)} needs group_of_one=True"


def test_ddp_comm_runs_on_one_rank(monkeypatch, capsys):
    from course_lib.recipes import ddp_comm

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    try:
        ddp_comm.main(["--bucket-mb", "25", "--steps", "1"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert "bucket_cap_mb=25.0" in capsys.readouterr().out


def test_op_share_counts_each_moment_once_on_a_recorded_cpu_trace():
    a = torch.randn(128, 128)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            torch.relu(torch.matmul(a, a) + 1.0)
    hit, total = timing.op_share(prof, ("aten::mm", "aten::matmul"), "cpu")
    top_level = sum(e.cpu_time_total for e in prof.events() if e.cpu_parent is None)
    assert total == pytest.approx(top_level, rel=1e-6)  # the time measured, not its double
    assert 0 < hit < total


def test_op_share_on_a_gpu_counts_the_kernel_rows_only():
    from torch.autograd import DeviceType

    def row(key, kind, us):
        return SimpleNamespace(key=key, device_type=kind, self_device_time_total=us, self_cpu_time_total=0)
    rows = [row("aten::mm", DeviceType.CPU, 60), row("aten::add", DeviceType.CPU, 40),
            row("sm90_xmma_gemm_f32", DeviceType.CUDA, 60), row("elementwise_kernel", DeviceType.CUDA, 40)]
    prof = SimpleNamespace(key_averages=lambda: rows)
    assert timing.op_share(prof, ("aten::mm",), "cuda") == (60, 100)  # not 60 of 200


# --- 4. DeepSpeed's bytes, counted on a real engine ------------------------------------------------------------
PSI = 16 * 32 + 32 + 32 * 8 + 8  # the parameters of small_model(): 808


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


@pytest.fixture
def engine_after_backward(group_of_one, monkeypatch):
    """`engine_after_backward(config, precision)`: a real DeepSpeed engine on the CPU over the one-rank group, one
    backward done (its step() left to the test); destroyed after the test, before the group."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("LOCAL_RANK", "0")  # deepspeed.initialize asks for it (a launcher sets it)
    import deepspeed

    from course_lib.parallel import zero

    zero.no_jit()
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):  # DeepSpeed keeps the groups of the first engine in module globals:
        if name.startswith("_") and name.isupper() and value is not None:  # this test's group is a new one
            monkeypatch.setattr(groups, name, None)
    engines = []

    def build(name: str, precision: str):
        config = zero.prepare(name, 1, micro_batch=2, accum_steps=1, hidden_size=16, lr=1e-3, precision=precision,
                              persistence_threshold=0)
        config["zero_optimization"]["memory_efficient_linear"] = False  # else ZeRO-3 swaps F.linear process-wide
        model = small_model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        engines.append(engine)
        x = torch.randn(2, 16, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
        engine.backward(engine(x).float().pow(2).mean())
        return engine
    yield build
    for engine in engines:
        engine.destroy()


# (config, precision): the bytes a rank holds per parameter (one rank: nothing is split), and the bytes of AdamW's
# step counters (one per flat fp32 partition under ZeRO, one per parameter tensor without it)
HELD = {
    ("zero0", "bf16"): (dict(params=2, grads=2, optimizer=12, host=0), 4 * 4),
    ("zero0", "fp32"): (dict(params=4, grads=4, optimizer=8, host=0), 4 * 4),  # no master copy
    ("zero1", "bf16"): (dict(params=2, grads=2, optimizer=12, host=0), 4),
    ("zero2", "bf16"): (dict(params=2, grads=2, optimizer=12, host=0), 4),
    ("zero2_offload", "bf16"): (dict(params=2, grads=4, optimizer=12, host=12 + 4), 4),  # fp32 grads on the host
    ("zero3", "bf16"): (dict(params=2, grads=2, optimizer=12, host=0), 4),
    ("zero3_offload", "bf16"): (dict(params=2, grads=2, optimizer=12, host=2 + 2 + 12), 4),  # all of it
}


@pytest.mark.parametrize("name,precision", HELD)
def test_held_bytes_reads_a_real_engine_and_fails_by_name_on_a_renamed_attribute(engine_after_backward, monkeypatch,
                                                                                   name, precision):
    """held_bytes on DeepSpeed's own optimizer objects: the gradients before step(), the rest after it, equal to
    the ZeRO paper's 2 + 2 + 12 bytes a parameter and offload's host tier. Each private attribute it reads
    (zero.READS), removed, is an error that names it and DeepSpeed's version, never a count of 0."""
    import deepspeed

    from course_lib.parallel import zero

    per_param, steps = HELD[name, precision]
    want = {k: v * PSI for k, v in per_param.items()}
    want["optimizer"] += steps
    want["host"] += steps if want["host"] else 0  # offload: the optimizer's state, counters included
    engine = engine_after_backward(name, precision)
    assert zero.held_bytes(engine)["grads"] == want.pop("grads")  # what step() consumes
    engine.step()
    held = zero.held_bytes(engine)
    assert {k: held[k] for k in want} == want
    opt = engine.optimizer
    reads = () if isinstance(opt, torch.optim.Optimizer) else zero.READS[engine.zero_optimization_stage()]
    assert reads or precision == "fp32"  # fp32 without ZeRO: the torch optimizer itself, nothing private
    for attribute in reads:
        with monkeypatch.context() as m:
            m.delattr(opt, attribute)
            with pytest.raises(AttributeError, match=rf"DeepSpeed {re.escape(deepspeed.__version__)}: .* {attribute}\b"):
                zero.held_bytes(engine)


# --- 5. the cpu profile hides the GPUs ----------------------------------------------------------------------
def test_hidden_gpus_make_the_cpu_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert env.pick_device().type == "cpu" and env.cuda_count() == 0 and env.max_ranks() == env.cpu_cores()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert env.pick_device().type == "cuda" and env.cuda_count() == 8


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_runner_gives_the_cpu_profiles_kernels_no_gpu(monkeypatch, tmp_path, profile):
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what the runner sets stays in this test
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path))
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(env, "cuda_count", lambda: 2)  # a GPU machine: quiet_env would not set DS_ACCELERATOR
    seen = {}

    def execute(book, profile, out_dir, **kw):
        seen.update(gpus=os.environ["CUDA_VISIBLE_DEVICES"], ds=os.environ.get("DS_ACCELERATOR"))
        return runner.Outcome(book.stem, "ok", 0.0)
    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(runner, "write_book", lambda build: (build / "index.html", 0))
    monkeypatch.setattr(runner, "write_report", lambda build: build / "report.html")
    runner.run(profile, only="00", warm=False)  # in this process (a kernel started ahead gets this same environment)
    assert seen["gpus"] == ("" if profile == "cpu" else "0,1")
    assert seen["ds"] == ("cpu" if profile == "cpu" else None)  # DeepSpeed too; with the GPUs it picks CUDA itself


# --- 6. timers ----------------------------------------------------------------------------------------------
@pytest.fixture
def syncs(monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "synchronize", lambda device=None: calls.append(device))
    return calls


def test_now_and_timed_synchronize_and_leave_the_warm_up_out(syncs):
    timing.now()
    assert len(syncs) == 1
    runs = []

    def step():  # the first call is the slow one: set-up
        runs.append(1)
        time.sleep(0.3 if len(runs) == 1 else 0.0)
        return len(runs)
    out, seconds = timing.timed(step, warmup=1)
    assert out == 2 and seconds < 0.2 and len(syncs) == 3  # before and after the timed call


def test_pipeline_compute_times_are_read_after_a_synchronize(syncs):
    from course_lib.parallel import pipeline_parallel as ppl

    stage, log = SimpleNamespace(forward_one_chunk=lambda: "f", backward_one_chunk=lambda: "b"), []
    loss = ppl.record_compute(stage, log, lambda: "l")
    stage.forward_one_chunk(), stage.backward_one_chunk(), loss()
    assert [e[0] for e in log] == ["F", "B", "L"] and len(syncs) == 6  # before and after each


class Event:
    """A stand-in for torch.cuda.Event: records the host clock."""

    def __init__(self, enable_timing):
        self.at = None

    def record(self):
        self.at = time.perf_counter()

    def elapsed_time(self, other):
        return 1e3 * (other.at - self.at)


def test_clock_marks_cuda_events_and_synchronizes_before_reading_them(syncs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = timing.Clock("cuda")
    a, b = clock.mark(), clock.mark()
    assert not syncs and isinstance(a, Event)  # marking waits for nothing
    assert clock.seconds(a, b) >= 0 and len(syncs) == 1
    cpu = timing.Clock("cpu")
    assert isinstance(cpu.mark(), float)


def test_the_gather_timeline_marks_gpu_moments_and_waits_for_the_gpu(group_of_one, syncs, monkeypatch):
    """Chapter 07's timeline (`comm.time_forward`, also chapter 08's TP recipe): layer moments are the Clock's marks
    (CUDA events on a GPU), the forward's seconds are read after a synchronize."""
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(timing.Clock, "__init__", lambda self, device=None: setattr(self, "cuda", True))  # a GPU's clock
    size = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=64)
    model = cl.models.tiny_qwen2(**size)
    layers = {f"L{i}": m for i, m in enumerate(model.model.layers)}
    out = cl.comm.time_forward(model, cl.models.random_batch(64, 2, 8), layers, repeat=2)
    assert [n for n, _, _ in out["layers"]] == ["L0", "L1"] and len(out["forward_s"]) == 2
    assert all(0 <= a <= b <= out["forward_s"][-1] for _, a, b in out["layers"])
    assert len(syncs) >= 2 * 2 + 2 * 2  # now() before and after each forward; each span read after a synchronize


# --- 7. deterministic resumes -------------------------------------------------------------------------------
def test_deterministic_sets_cublas_workspace_and_algorithms_on_cuda_only(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        env.deterministic("cpu")
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        env.deterministic("cuda")
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_recipes_that_check_exact_resume_ask_for_determinism_before_cuda_starts(monkeypatch, tmp_path):
    """Run each recipe up to its `cl.dist.init` (where CUDA starts), with the calls recorded: determinism first."""
    from course_lib.recipes import sft, zero

    calls = []

    class Started(Exception):
        pass

    def init(*args, **kwargs):
        calls.append("init")
        raise Started

    monkeypatch.setattr(cl.env, "deterministic", lambda *a, **kw: calls.append("deterministic"))
    monkeypatch.setattr(cl.dist, "init", init)
    runs = {"sft (a run that saves checkpoints)": lambda: sft.train(sft.Config(out_dir=str(tmp_path), save_every=1)),
            "zero": lambda: zero.main([])}
    for name, run in runs.items():
        calls.clear()
        with pytest.raises(Started):
            run()
        assert calls == ["deterministic", "init"], f"{name}: {calls}"


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200 NVL", 835e12),
                                        ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("NVIDIA A10", 125e12), ("NVIDIA GeForce GTX 1080", None)])
def test_peak_flops_reads_the_card_by_its_name(monkeypatch, name, peak):
    """The data-sheet peak follows the device name: a PCIe or NVL card is not its SXM namesake, an A100 not an A10."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert timing.peak_flops("cuda") == peak
    assert timing.peak_flops("cuda", torch.float32) is None
