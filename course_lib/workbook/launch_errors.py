"""Reading a failed distributed run: which rank caused it, its exit code, its Python error.

`cl.launch` (course_lib/workbook/launch.py) collects every output line of a run; when the run fails,
`failure_message` turns them into one `LaunchError` message: the root-cause rank (the first whose own
error is not a consequence of another rank's death), its exit code and signal, and the end of its
traceback (for a rank killed by a signal, which prints none: where faulthandler says its Python code was),
then one line for each other rank. Chapter 05 shows it on a provoked failure.
"""
from __future__ import annotations

import re
import signal
from collections import defaultdict

_LAUNCHER_PREFIX = re.compile(r"^\[default(\d+)\]:")  # torchrun --tee: "[default1]:..."
_TORCH_PREFIX = re.compile(r"^\[rank(\d+)\]: ?")  # torch's own prefix on an uncaught exception
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b:?")
_CONSEQUENCE = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crashing|"
                          r"Broken pipe|SIGTERM")


def split_rank(line: str) -> tuple[int | None, str]:
    """`(rank, text)` of one output line: torchrun's `[default1]:` and torch's `[rank1]:` prefixes removed."""
    rank = None
    m = _LAUNCHER_PREFIX.match(line)
    if m:
        rank, line = int(m.group(1)), line[m.end():]
    m = _TORCH_PREFIX.match(line)
    if m:
        rank, line = int(m.group(1)), line[m.end():]
    return rank, line


def failure_message(script: str, lines: list[str], returncode: int, stuck: dict | None = None) -> str:
    """One message for a failed run: the rank that caused it, its exit code, its Python error.

    The root cause is the first rank whose own Python error is not a consequence of another rank's
    death ("Connection closed by peer"); else a rank killed by a signal the launcher did not send
    (kill -9); else the launcher's own verdict.
    """
    by_rank: dict[int | None, list[str]] = defaultdict(list)
    for line in lines:
        rank, body = split_rank(line)
        by_rank[rank].append(body)
    codes = _exit_codes("\n".join(lines))
    root = codes.pop("root", None)
    errors = {r: _python_error(body) for r, body in by_rank.items() if r is not None}
    errors = {r: e for r, e in errors.items() if e}
    order = [r for r in _first_error_order(lines) if r in errors]
    own = [r for r in order if not _CONSEQUENCE.search(errors[r][-1])]
    killed = [r for r, c in codes.items() if c < 0 and -c not in (signal.SIGTERM, signal.SIGABRT)]
    if own:
        rank = own[0]
    elif killed:
        rank = killed[0]
    elif root is not None or codes:
        rank = root if root is not None else next(iter(codes))
    else:
        rank = order[0] if order else None
    if rank is None:
        head = f"{script}: the launcher exited with code {returncode} before any rank reported an error"
        return head + "\n" + excerpt(lines)
    code = codes.get(rank)
    how = "failed" if code is None else f"failed with exit code {code}{_signal_name(code)}"
    text = [f"{script}: rank {rank} {how}"]
    unprefixed = _python_error(by_rank.get(None, []), which=0)  # the deepspeed launcher does not prefix lines
    fatal = _fatal_error(by_rank.get(rank, []))  # faulthandler's dump, for a rank killed by a signal
    if rank in errors:
        text += [f"  | {ln}" for ln in errors[rank]]
    elif unprefixed and "ChildFailedError" not in unprefixed[-1]:
        text.append("  (an error printed without a rank prefix:)")
        text += [f"  | {ln}" for ln in unprefixed]
    elif fatal:
        text.append(f"  (no Python error from rank {rank}; where its Python code was, from faulthandler:)")
        text += [f"  | {ln}" for ln in fatal]
    else:
        text.append(f"  (no Python error from rank {rank}; its last lines:)")
        text += [f"  | {ln}" for ln in by_rank.get(rank, [])[-8:]]
    for other in sorted(r for r in set(errors) | set(codes) if r != rank):
        code = codes.get(other)
        what = errors[other][-1] if other in errors else "no Python error"
        text.append(f"  then rank {other}{'' if code is None else f' (exit code {code}{_signal_name(code)})'}: {what[:200]}")
    for other, state in sorted((stuck or {}).items()):
        text.append(f"  rank {other} never exited ({state}): killed after the launcher's teardown stalled")
    return "\n".join(text)


def _exit_codes(text: str) -> dict:
    """{rank: exit code} from the launcher's failure summary; key "root" holds torchrun's root cause."""
    codes: dict = {}
    for m in re.finditer(r"rank\s*:\s*(\d+)\s*\(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", text):
        codes.setdefault(int(m.group(1)), int(m.group(2)))
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", text, re.S)
    if root:
        codes["root"] = int(root.group(1))
    for m in re.finditer(r"--local_rank=(\d+)'\] exits with return code = (-?\d+)", text):  # deepspeed
        codes.setdefault(int(m.group(1)), int(m.group(2)))
    return codes


def _python_error(lines: list[str], keep: int = 10, which: int = -1) -> list[str]:
    """The end of the last (`which`) Python traceback in `lines`: where it was raised, and the error line."""
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if not starts:
        return [ln for ln in lines if _ERROR_LINE.match(ln)][which:][:1]
    block = lines[starts[which]:]
    end = next((i for i, ln in enumerate(block) if i and ln and not ln[0].isspace()), None)
    if end is None:
        return []
    block = block[:end + 1]
    return block if len(block) <= keep else [block[0], "  ..."] + block[-(keep - 2):]


def _fatal_error(lines: list[str], keep: int = 8) -> list[str]:
    """Python's faulthandler dump (cl.launch sets PYTHONFAULTHANDLER) of a rank killed by a signal, such as a C++
    `std::terminate` (SIGABRT) or a segfault: its first line and the innermost frames of the thread that ran then
    (`<no Python frame>`: a thread of C++ code, or the interpreter shutting down)."""
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error:")]
    if not starts:
        return []
    block = lines[starts[-1]:]
    current = next((i for i, ln in enumerate(block) if ln.startswith("Current thread")), None)
    if current is None:
        return block[:1]
    frames = []
    for ln in block[current:current + keep + 1]:
        if not ln.strip():
            break
        frames.append(ln)
    return [block[0], *frames]


def _first_error_order(lines: list[str]) -> list[int]:
    order = []
    for line in lines:
        rank, body = split_rank(line)
        if rank is not None and rank not in order and body.startswith("Traceback"):
            order.append(rank)
    return order


def _signal_name(code: int) -> str:
    try:
        return f" ({signal.Signals(-code).name})" if code < 0 else ""
    except ValueError:
        return ""


def excerpt(lines: list[str], n: int = 15) -> str:
    return "\n".join(f"  | {ln}" for ln in lines[-n:])
