"""Does the Docker image's Python dependency set resolve? Checked without Docker, as far as pip can.

The image (docker/Dockerfile) installs `.[course,gpu,book,test]` from pyproject.toml through docker/requirements.py on
Ubuntu 24.04's Python 3.12, x86-64, with PyPI's CUDA torch 2.13.0. This machine has no Docker daemon and
cannot pull the CUDA base image, so this asks pip's resolver the same question instead:

1. stage 1 (the DeepSpeed build): torch's pin + docker/build-requirements.txt;
2. stage 2 (the image): `docker/requirements.py --extras course,gpu,book,test` with DeepSpeed replaced by its own
   requirements (PyPI has it only as an sdist: they are read from the sdist's requirements/requirements.txt,
   since building it needs CUDA; the image builds it in stage 1);

each as `pip install --dry-run --report`, binary wheels only, for CPython 3.12 manylinux x86-64 (glibc up to
2.39, Ubuntu 24.04's). It prints what resolved (count, torch and its CUDA, the CUDA libraries) and what it
could NOT check. Exit code 0 when both resolve.

    python tools/check_image_deps.py          (tests/test_gpu_ready.py runs it; needs PyPI)
"""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_wheels import PLATFORM, REPO, modern_pip, norm, req_name  # noqa: E402  (one platform list, one pip)

sys.path.insert(0, str(REPO / "docker"))
import requirements as image_requirements  # noqa: E402  (docker/requirements.py: the image's own list)

NOT_CHECKED = [
    "the base image nvidia/cuda:13.0.2-devel-ubuntu24.04 and its apt packages (no registry reachable here)",
    "compiling DeepSpeed's ops with nvcc for the target GPUs (stage 1 needs the CUDA devel image)",
    "that the CUDA libraries load together at run time: TensorFlow's CUDA 12 and torch's CUDA 13 wheels unpack "
    "NCCL/cuDNN into the same folders (the image reinstalls torch's pins last; docker/check_image.py checks in the image)",
    "anything needing a GPU or a driver (run `docker compose run --rm lab check` on a GPU host)",
]


def deepspeed_requirements(pin: str, work: Path, env: dict) -> list[str]:
    """DeepSpeed's run-time requirements, read from its sdist (no build: building needs CUDA and torch)."""
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                           "-d", str(work), pin], env=env, capture_output=True, text=True, timeout=300)  # a 2 MB sdist
    if done.returncode:
        sys.exit(f"error: could not download the sdist of {pin}: {done.stderr.strip()[-500:]}")
    sdist = next(work.glob("deepspeed-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/requirements/requirements.txt"))
        text = tar.extractfile(member).read().decode()
    return [ln.split("#")[0].strip() for ln in text.splitlines() if ln.split("#")[0].strip()]


def dry_run(name: str, requirements: list[str], work: Path, env: dict) -> list[dict] | None:
    """Resolve for the image's platform; print the outcome; the resolved distributions, or None."""
    (work / f"{name}.txt").write_text("\n".join(requirements) + "\n")
    report = work / f"{name}.json"
    # fast-deps: pip reads each wheel's metadata with range requests (the whole wheel where an index cannot serve
    # them) instead of downloading torch's and the CUDA libraries' gigabytes: 19 s of CPU here instead of 42
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--use-feature=fast-deps", "--target", str(work / "target"), "--report", str(report),
                           *PLATFORM, "-r", str(work / f"{name}.txt")], env=env, capture_output=True, text=True,
                          timeout=600)  # ~25 s here: metadata of a few hundred distributions from PyPI
    if done.returncode:
        err = "\n".join(ln for ln in done.stderr.splitlines() if not ln.startswith("WARNING: Location"))
        print(f"FAILED {name}: {len(requirements)} requirements do not resolve:\n{err[-3000:]}")
        return None
    items = [i["metadata"] for i in json.loads(report.read_text())["install"]]
    versions = {norm(m["name"]): m["version"] for m in items}
    cuda = sorted(f"{n}=={v}" for n, v in versions.items() if n.startswith(("nvidia-", "cuda-")))
    print(f"ok     {name}: {len(requirements)} requirements -> {len(items)} distributions; torch {versions.get('torch')}"
          + (f", tensorflow {versions['tensorflow']}" if "tensorflow" in versions else "")
          + (f"; {len(cuda)} CUDA wheels: {', '.join(cuda)}" if cuda else ""))
    return items


def main() -> int:
    env = modern_pip()
    print("Python 3.12, CPython, manylinux x86-64 (glibc <= 2.39), binary wheels only; deepspeed apart (sdist)")
    image = image_requirements.requirements(["gpu", *image_requirements.COURSE_EXTRAS])
    ds_pin = next(r for r in image if req_name(r) == "deepspeed")
    torch_pin = next(r for r in image if req_name(r) == "torch")
    build = [ln.strip() for ln in (REPO / "docker" / "build-requirements.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ds_reqs = deepspeed_requirements(ds_pin, work, env)
        print(f"{ds_pin} (sdist) needs: {', '.join(ds_reqs)}")
        stage1 = dry_run("stage-1 deepspeed build", [torch_pin, *build], work, env)
        stage2 = dry_run("stage-2 image .[course,gpu,book,test]", [r for r in image if req_name(r) != "deepspeed"] + ds_reqs,
                         work, env)
    ok = stage1 is not None and stage2 is not None
    if ok:
        torch = next(m for m in stage2 if norm(m["name"]) == "torch")
        wants = torch_pin.split("==")[1]
        if torch["version"] != wants:
            print(f"FAILED: resolved torch {torch['version']}, pyproject pins {wants}")
            ok = False
    print("not checked here:\n" + "\n".join(f"  - {line}" for line in NOT_CHECKED))
    print(f"check_image_deps: {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
