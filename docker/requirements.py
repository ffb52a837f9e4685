"""The image's dependency list, read from pyproject.toml (the one place versions live).

    python docker/requirements.py --extras course,gpu,book,test  # every requirement, one per line
    python docker/requirements.py --only torch,deepspeed # just these pins
    python docker/requirements.py --torch-cuda-libs      # the NCCL/cuDNN wheels the installed torch pins (none: CPU)
    (--pyproject PATH reads another copy of pyproject.toml: the Dockerfile's stages copy it alone)

The Dockerfile installs through this script, so the image cannot drift from pyproject.toml
(tests/test_docker.py checks that too). `--torch-cuda-libs` exists because TensorFlow's CUDA 12
wheels and torch's CUDA 13 wheels both unpack NCCL (and cuDNN) into the same site-packages
folders; whichever pip installs last wins, so the image reinstalls torch's pins last and
docker/check_image.py verifies that torch loads exactly them.
"""
from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
TORCH_CUDA_LIBS = ("nvidia-nccl", "nvidia-cudnn")
# The whole course, beside the flavour's extra (cpu or gpu): Jupyter and the runner, the book, the tests.
COURSE_EXTRAS = ["course", "book", "test"]


def name_of(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;@]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def requirements(extras: list[str] = (), only: list[str] = (), pyproject: Path = PYPROJECT) -> list[str]:
    """pyproject's dependencies plus the named extras; with `only`, just those packages' lines."""
    project = tomllib.loads(Path(pyproject).read_text())["project"]
    found = list(project["dependencies"])
    for extra in extras:
        if extra not in project["optional-dependencies"]:
            raise SystemExit(f"error: pyproject.toml has no extra {extra!r}")
        found += project["optional-dependencies"][extra]
    if only:
        wanted = {n.lower() for n in only}
        found = [r for r in found if name_of(r) in wanted]
        missing = wanted - {name_of(r) for r in found}
        if missing:
            raise SystemExit(f"error: pyproject.toml does not list {', '.join(sorted(missing))}")
    return found


def torch_cuda_libs() -> list[str]:
    """torch's own `nvidia-nccl-*` / `nvidia-cudnn-*` pins (markers evaluated for this machine)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    pins = []
    for line in requires("torch") or []:
        req = Requirement(line)
        if req.name.startswith(TORCH_CUDA_LIBS) and (req.marker is None or req.marker.evaluate({"extra": ""})):
            pins.append(f"{req.name}{req.specifier}")
    return pins  # none for a CPU build of torch (the CPU image): nothing to reinstall


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extras", default="", help="comma-separated extras of pyproject.toml, e.g. course,gpu,book,test")
    parser.add_argument("--only", default="", help="comma-separated package names")
    parser.add_argument("--torch-cuda-libs", action="store_true", help="print the installed torch's NCCL/cuDNN pins")
    parser.add_argument("--pyproject", default=str(PYPROJECT), help="path of pyproject.toml")
    args = parser.parse_args(argv)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]
    if args.torch_cuda_libs:
        lines = torch_cuda_libs()
    else:
        lines = requirements(split(args.extras), split(args.only), Path(args.pyproject))
    if lines:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
