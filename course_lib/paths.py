"""Where things are: the repository, the chapters, the build folder and committed reference results.

Imported by the ledger (course_lib.workbook.results), the runner, the report and the book, so none of them has
to import another for a path. Nothing here imports the rest of course_lib.
"""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO_ROOT / "notebooks"
REFERENCES = REPO_ROOT / "results"  # committed runs from other machines, e.g. results/h200-torch2.11-transformers5.17/


def build_dir() -> Path:
    """`build/` at the repo root, or wherever COURSE_BUILD_DIR points (the runner and tests set it)."""
    return Path(os.environ.get("COURSE_BUILD_DIR", REPO_ROOT / "build"))


def compile_cache_dir() -> Path:
    """Where torch.compile keeps its kernels (TORCHINDUCTOR_CACHE_DIR) for the chapters and the tests: build/cache/
    inductor, not /tmp, which a container loses. Chapter 10's benchmark cell took 94 s in a fresh container, 40 s with
    the cache of a run before, 68 s with the host's (the image test after `make test`)."""
    return build_dir() / "cache" / "inductor"


def all_notebooks() -> list[Path]:
    """The chapters, notebooks/NN_*.ipynb, in order."""
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def reference_dirs(root: Path | None = None) -> dict[str, Path]:
    """Committed reference runs, by label: every folder under results/ laid out like build/ (at least
    `results/*.json` ledgers; `executed/*.ipynb`, `runs.json` and `figures/` when present).
    The book shows them beside this machine's figures (course_lib.workbook.book)."""
    root = Path(root or os.environ.get("COURSE_REFERENCES") or REFERENCES)
    if not root.is_dir():
        return {}
    return {d.name: d for d in sorted(root.iterdir()) if (d / "results").is_dir() or (d / "executed").is_dir()}
