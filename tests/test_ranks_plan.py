"""Where the multi-rank parts run: `cl.presets.ranks_plan` on this CPU box, on a pretend single GPU and on a
pretend 4-GPU machine. Only the planning logic and the launch environment are tested here (torch.cuda is
monkeypatched; nothing touches a device): a rank launched under the plan's env sees no GPU, which the CPU
profile's chapter runs already exercise."""
import os

import pytest
import torch
from conftest import schedule

import course_lib as cl
from course_lib.presets import ranks_plan
from course_lib.workbook import launch as launch_mod  # the module; `cl.launch` is its function

MULTI_RANK = ("05", "06", "07", "08", "11", "12")  # the chapters whose lesson needs 2+ ranks (12: its DDP step)


def pretend_gpus(monkeypatch, n: int) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # a machine that shows its GPUs (the cpu profile hides them)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.parametrize("chapter", MULTI_RANK)
def test_one_gpu_runs_the_multi_rank_parts_as_two_gloo_ranks_at_cpu_sizes(monkeypatch, chapter):
    pretend_gpus(monkeypatch, 1)
    P = cl.preset("gpu", chapter=chapter)
    assert P.nproc == 1  # what "all" resolves to on one GPU: the collapse this plan avoids
    plan = ranks_plan(P)
    assert plan.nproc >= 2 and plan.device == "cpu" and plan.backend == "gloo"
    assert plan.env == {"CUDA_VISIBLE_DEVICES": ""}
    assert plan.P.name == "cpu" and plan.P.chapter == chapter and plan.P.model == cl.preset("cpu", chapter).model
    assert "1 GPU visible" in plan.reason and "gloo ranks on the CPU" in plan.reason and "on the GPU" in plan.reason


@pytest.mark.parametrize("chapter", MULTI_RANK)
def test_the_cpu_profile_and_a_multi_gpu_machine_keep_their_own_ranks(monkeypatch, chapter):
    P = cl.preset("cpu", chapter=chapter)
    plan = ranks_plan(P)
    assert (plan.nproc, plan.backend, plan.env, plan.P) == (P.nproc, "gloo", cl.env.CPU_PROFILE_ENV, P)
    pretend_gpus(monkeypatch, 4)
    plan = ranks_plan(cl.preset("gpu", chapter=chapter))
    assert (plan.nproc, plan.device, plan.backend, plan.env, plan.P.name) == (4, "cuda", "nccl", {}, "gpu")


def test_the_cpu_profile_hides_the_gpus_from_the_kernel_and_its_ranks(monkeypatch):
    """profile="cpu" in JupyterLab on a GPU machine: after `cl.setup(P)` the kernel picks the CPU and what it launches
    sees no GPU, as under the runner; the single-GPU plan reads the cpu sizes without hiding the kernel's GPU."""
    pretend_gpus(monkeypatch, 1)
    assert cl.pick_device().type == "cuda"
    plan = ranks_plan(cl.preset("gpu", chapter="05"))
    assert plan.P.name == "cpu" and cl.pick_device().type == "cuda" and "CUDA_VISIBLE_DEVICES" not in os.environ
    P = cl.preset("cpu", chapter="05")
    assert P.device == "cpu" and cl.pick_device().type == "cuda"  # values only: the kernel is as it was
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # (restored after the test, as CUDA_VISIBLE_DEVICES is)
    cl.setup(P)
    assert cl.pick_device().type == "cpu"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and os.environ["DS_ACCELERATOR"] == "cpu"  # launched ranks inherit it
    assert ranks_plan(P).env == {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}  # and the plan says it too


def test_a_plan_never_has_one_rank(monkeypatch):
    P = cl.preset("cpu", chapter="05", nproc=1)
    with pytest.raises(ValueError, match="need 2 or more"):
        ranks_plan(P)


def test_launch_under_the_plan_starts_cpu_ranks_on_a_one_gpu_machine(monkeypatch, tmp_path):
    """With the plan's env, `cl.launch` allows 2 ranks beside 1 GPU, hands them gloo and CPU DeepSpeed, and
    the deepspeed launcher counts CPU ranks; without it, 2 ranks on 1 GPU are refused before anything starts."""
    pretend_gpus(monkeypatch, 1)
    plan = ranks_plan(cl.preset("gpu", chapter="06"))
    seen = {}

    def fake_launch_once(script, args, nproc, launcher, timeout, env, quiet, gpus, *rest):
        seen.update(env=env, gpus=gpus, command=launch_mod.build_command(script, args, nproc, launcher, 1, gpus))
        return launch_mod.Run(command=[], returncode=0)

    monkeypatch.setattr(launch_mod, "_launch_once", fake_launch_once)
    script = tmp_path / "x.py"
    script.write_text("")
    cl.launch(script, nproc=plan.nproc, launcher="deepspeed", env=plan.env)
    assert seen["gpus"] == 0 and seen["env"]["CUDA_VISIBLE_DEVICES"] == "" and seen["env"]["COURSE_BACKEND"] == "gloo"
    assert seen["env"]["DS_ACCELERATOR"] == "cpu" and "--num_accelerators" in seen["command"]
    with pytest.raises(ValueError, match="1 GPUs: at most 1"):
        cl.launch(script, nproc=2, launcher="torchrun")


def test_every_chapter_has_a_derived_gpu_time():
    from course_lib.presets import GPU_SECONDS, PRESETS

    assert set(GPU_SECONDS) == set(PRESETS["gpu"]["chapters"])
    assert all(seconds > 0 and how for seconds, how in GPU_SECONDS.values())


def test_one_gpu_runs_the_cpu_rank_chapters_beside_the_gpu_one(monkeypatch, tmp_path):
    """On one GPU the chapters of CPU_RANK_CHAPTERS have all their ranks on the CPU (ranks_plan), so the runner's
    --jobs 2 runs them beside the chapter on the GPU: never two others at a time, the timed ones alone, 07 after
    06. On 2+ GPUs (their ranks on the GPUs) the gpu profile keeps one chapter at a time."""
    from course_lib.workbook import runner
    from course_lib.presets import CPU_RANK_CHAPTERS

    pretend_gpus(monkeypatch, 1)
    for chapter in CPU_RANK_CHAPTERS:
        assert ranks_plan(cl.preset("gpu", chapter=chapter)).device == "cpu"
    spans = schedule({b.stem[:2]: 10 + int(b.stem[:2]) for b in runner.all_notebooks()}, 2, CPU_RANK_CHAPTERS)
    for num, (start, end) in spans.items():
        beside = [o for o, (s, e) in spans.items() if o != num and s < end and start < e]
        assert not (num in runner.TIMED and beside), (num, beside)
        assert num in CPU_RANK_CHAPTERS or all(o in CPU_RANK_CHAPTERS for o in beside), (num, beside)
    assert spans["07"][0] >= spans["06"][1] and any(s > 0 for s, _ in (spans[c] for c in CPU_RANK_CHAPTERS))
    monkeypatch.setattr(os, "environ", {**os.environ, "COURSE_BUILD_DIR": str(tmp_path)})  # what run() sets stays here
    monkeypatch.setattr(runner, "select", lambda only: [])  # the checks, not the chapters
    runner.run("gpu", jobs=2)
    pretend_gpus(monkeypatch, 2)
    with pytest.raises(ValueError, match="2 with the gpu profile on one GPU"):
        runner.run("gpu", jobs=2)



RANK_PROBE = """\
import json, os, sys
import torch

# A GPU host, as the rank's torch would find it if the GPU were visible: one device; set_device only records.
torch.cuda.is_available = lambda: os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1")
torch.cuda.device_count = lambda: int(torch.cuda.is_available())
chosen = []
torch.cuda.set_device = lambda device: chosen.append(str(device))
seen = os.environ.get("CUDA_VISIBLE_DEVICES")  # before course_lib is imported: what the launcher handed over
import course_lib as cl

ctx = cl.dist.init()
cl.dist.report({"rank": ctx.rank, "handed": seen, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "device": str(ctx.device), "set_device": chosen, "cuda_usable": cl.env.cuda_usable(),
                "omp": os.environ.get("OMP_NUM_THREADS"), "threads": torch.get_num_threads()})
cl.dist.close()
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_the_plans_cpu_ranks_see_no_gpu_whatever_the_launcher_rewrites(monkeypatch, tmp_path, launcher):
    """On one GPU the plan hides the GPU from its ranks (CUDA_VISIBLE_DEVICES=""). DeepSpeed's per-node launcher
    (deepspeed/launcher/launch.py) then writes its accelerator ids over it for the CPU accelerator
    (CUDA_VISIBLE_DEVICES="0,1"), so each rank saw the one GPU and rank 1 asked for cuda:1. Launched for real here,
    with a rank script whose torch pretends that GPU is there: every rank must see no GPU, take the CPU, never call
    set_device, and run one thread (CPU ranks beside a GPU chapter on a 16-core host, as on the cpu profile)."""
    pretend_gpus(monkeypatch, 1)
    monkeypatch.setattr(launch_mod, "cpu_cores", lambda: 16)
    plan = ranks_plan(cl.preset("gpu", chapter="06"))
    probe = tmp_path / "probe.py"
    probe.write_text(RANK_PROBE)
    run = cl.launch(probe, nproc=plan.nproc, launcher=launcher, env=plan.env, timeout=150, quiet=True)
    seen = sorted(run.results, key=lambda r: r["rank"])
    assert [r["rank"] for r in seen] == list(range(plan.nproc)), run.lines[-20:]
    if launcher == "deepspeed":  # what the launcher hands over (why the rank side must hide the GPU again)
        assert {r["handed"] for r in seen} == {",".join(map(str, range(plan.nproc)))}
    for r in seen:
        assert r["visible"] == "" and not r["cuda_usable"] and r["device"] == "cpu" and r["set_device"] == [], r
        assert r["omp"] == "1" and r["threads"] == 1, r
