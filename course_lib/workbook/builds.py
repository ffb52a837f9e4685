"""Build it yourself: exercises where the learner writes the mechanism and the check runs it for real.

A build exercise's cell defines a function or class named like the exercise, on its own: the check runs the
cell's text alone, with its own imports and none of the notebook's variables:

    # Exercise ddp_from_hooks: make every rank start from rank 0's weights, then average each gradient
    import torch.distributed as dist

    def ddp_from_hooks(model):
        ...

`ex.check("ddp_from_hooks")` (course_lib/workbook/exercises.py) then compares it with the upstream implementation
(`DistributedDataParallel`, peft, ...) on three gloo ranks where the mechanism is distributed, in one process where
it is not, and answers "correct" or "not yet" with the first difference found: which rank, which tensor, how far
off, and what that points at. Every check runs in processes of its own, never in the notebook's kernel, each
candidate bounded in time and memory: a cell that never returns or keeps allocating ends in one sentence, and the
kernel goes on. The checks are in course_lib/recipes/build_check.py; the reference solutions beside the other
exercises' (course_lib/workbook/solutions/NN.py, a block marked `# build: yes`).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ..recipes import build_check

HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}  # the checks compare CPU tensors on gloo ranks, on any machine


def run(candidates: dict, timeout: float = 180, *, limit_s: float = build_check.LIMIT_S,
        memory_gb: float = build_check.MEMORY_GB) -> dict:
    """{exercise: {label: cell source}} -> {exercise: {label: None (correct) or the first difference}}, all in one
    launch: the single-process checks first, on rank 0, then the distributed ones on every rank. A candidate that
    ends its launch (it waited in a collective no other rank joined, or a rank was killed) gets its sentence, and
    the candidates after it run in a launch of their own. `limit_s`, `memory_gb`: one candidate's bounds on a rank;
    `timeout`: a launch's."""
    queue = []
    for name, cells in candidates.items():
        if name not in build_check.CHECKS:
            raise KeyError(f"{name}: not a build exercise (known: {', '.join(sorted(build_check.CHECKS))})")
        queue += [(name, label, source) for label, source in cells.items()]
    queue.sort(key=lambda c: build_check.CHECKS[c[0]].ranks)  # (stable: each exercise's labels keep their order)
    out = {name: {} for name in candidates}
    while queue:
        nproc = max(build_check.CHECKS[name].ranks for name, _, _ in queue)
        results, problem = _launch(queue, nproc, timeout, limit_s, memory_gb)
        started = {(r["exercise"], r["label"]) for r in results if r.get("started")}
        left = []
        for name, label, _ in queue:
            if (name, label) in started:
                ranks = build_check.CHECKS[name].ranks
                out[name][label] = _message(name, [r for r in results if (r["exercise"], r["label"]) == (name, label)],
                                            ranks, problem)
            else:
                left.append((name, label, _))
        if len(left) == len(queue):  # nothing started: the launch itself failed
            for name, label, _ in left:
                out[name][label] = f"the check did not start ({problem or 'no rank reported'})"
            break
        queue = left
    return out


def _launch(queue: list, nproc: int, timeout: float, limit_s: float, memory_gb: float) -> tuple[list, str]:
    from .launch import LaunchError, launch

    with tempfile.TemporaryDirectory(prefix="build-check-") as tmp:
        path = Path(tmp) / "candidates.json"
        path.write_text(json.dumps(queue))
        problem = ""
        try:
            results = launch(build_check.__file__, ["--candidates", str(path), "--limit-s", str(limit_s),
                                                    "--memory-gb", str(memory_gb)],
                             nproc=nproc, timeout=timeout, env=HIDE_GPUS, quiet=True, oversubscribe=True).results
        except LaunchError as e:  # a candidate stuck, or a rank killed: what the ranks reported still counts
            results, problem = (e.run.results if e.run else []), str(e).splitlines()[0]
    return results, problem


def _message(name: str, records: list, ranks: int, problem: str) -> str | None:
    """One candidate's answer from what its ranks reported: the first difference or error a rank found (the cause,
    where another rank then waited for it), else a limit it ran into, else a rank that never answered."""
    said = {r["rank"]: r["message"] for r in records if "message" in r and not r.get("limit")}
    for rank in range(ranks):
        message = said.get(rank)
        if message is not None:
            return message if ranks == 1 or message.startswith("rank ") else f"rank {rank}, {message}"
    limit = [r["message"] for r in records if r.get("limit")]
    if limit:
        return limit[0]
    silent = [rank for rank in range(ranks) if rank not in said]
    if silent:
        return f"your {name} stopped rank {silent[0]} before it answered ({problem or 'it ended without a word'})"
    return None


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
