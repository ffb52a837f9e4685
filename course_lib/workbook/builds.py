"""Build it yourself: exercises where the learner writes the mechanism and the check runs it for real.

A build exercise's cell defines a function or class named like the exercise, on its own: the check runs the
cell's text alone, with its own imports and none of the notebook's variables:

    # Exercise ddp_from_hooks: make every rank start from rank 0's weights, then average each gradient
    import torch.distributed as dist

    def ddp_from_hooks(model):
        ...

`ex.check("ddp_from_hooks")` (course_lib/workbook/exercises.py) then compares it with the upstream implementation
(`DistributedDataParallel`, peft, ...) on the chapter's two gloo ranks where the mechanism is distributed, in this
process where it is not, and answers "correct" or "not yet" with the first difference found: which rank, which
tensor, how far off. The checks are in course_lib/recipes/build_check.py; the reference solutions beside the
other exercises' (course_lib/workbook/solutions/NN.py, a block marked `# build: yes`).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ..recipes import build_check

HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}  # the checks compare CPU tensors on gloo ranks, on any machine


def run(candidates: dict, timeout: float = 180) -> dict:
    """{exercise: {label: cell source}} -> {exercise: {label: None (correct) or the first difference}}: the
    single-process checks here, all the distributed ones in one launch."""
    out, distributed = {}, {}
    for name, cells in candidates.items():
        if name not in build_check.CHECKS:
            raise KeyError(f"{name}: not a build exercise (known: {', '.join(sorted(build_check.CHECKS))})")
        if build_check.CHECKS[name].ranks == 1:
            out[name] = {label: build_check.verdict(name, source) for label, source in cells.items()}
        else:
            distributed[name] = cells
    if distributed:
        out.update(_launch(distributed, max(build_check.CHECKS[n].ranks for n in distributed), timeout))
    return out


def _launch(candidates: dict, nproc: int, timeout: float) -> dict:
    from .launch import LaunchError, launch

    with tempfile.TemporaryDirectory(prefix="build-check-") as tmp:
        path = Path(tmp) / "candidates.json"
        path.write_text(json.dumps(candidates))
        problem = ""
        try:
            results = launch(build_check.__file__, ["--candidates", str(path)], nproc=nproc, timeout=timeout,
                             env=HIDE_GPUS, quiet=True).results
        except LaunchError as e:  # a rank stuck or killed: what the others reported still counts
            results, problem = (e.run.results if e.run else []), str(e).splitlines()[0]
    reports = {(r["exercise"], r["label"], r["rank"]): r["message"] for r in results}
    out = {}
    for name, cells in candidates.items():
        out[name] = {}
        for label in cells:
            messages = [(rank, reports.get((name, label, rank), "gave no answer")) for rank in range(nproc)]
            wrong = [(rank, m) for rank, m in messages if m is not None]
            if wrong and all(m == "gave no answer" for _, m in wrong) and problem:
                wrong = [(wrong[0][0], f"the ranks did not finish ({problem}): a collective one rank never "
                                       "joined waits until the process group's timeout")]
            rank, message = wrong[0] if wrong else (0, None)
            out[name][label] = message if message is None or message.startswith("rank ") else f"rank {rank}, {message}"
    return out


def cell_source(name: str) -> str | None:
    """The text of the notebook cell that defines exercise `name` (its first line `# Exercise <name>`), the
    last one run; None outside IPython or before it ran."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    if shell is None:
        return None
    for text in reversed(shell.user_ns.get("In", [])):
        if text.lstrip().startswith(f"# Exercise {name}") and (text.lstrip()[len(f"# Exercise {name}"):][:1] in ":\n "):
            return text
    return None
