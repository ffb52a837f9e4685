"""TensorFlow is optional at run time: its sections skip, in one line, where it is not installed.

The default install has TensorFlow (the `cpu` and `gpu` extras), but a machine may not: a bare CUDA box
with only PyTorch, a torch-only environment. The TensorFlow parts of chapters 02, 03, 05 and 08 then say
what they skip and how to install it, and the ledger marks them `skipped`, not failed (`have_package` does the
same for another optional package, such as chapter 03's bitsandbytes):

    from course_lib.optional import have_tensorflow, require_tensorflow

    if have_tensorflow(ledger, "section 6, tf.recompute_grad"):   # False: one line printed, ledger says skipped
        ...
    require_tensorflow(ledger, "chapter 02")   # a chapter that is all TensorFlow: stops here (ChapterSkipped)

The runner (course_lib.runner) counts a chapter stopped by ChapterSkipped as `skipped`, and the report shows
skipped entries as such. To try it on a machine that has TensorFlow, hide it: put `tools/no_tensorflow` first
on PYTHONPATH (tests/test_gpu_ready.py does). This module imports nothing heavy.
"""
from __future__ import annotations

import importlib.util

INSTALL_HINT = 'pip install -e ".[cpu]" from the repo root (".[gpu]" on an NVIDIA machine), then restart the kernel'


class ChapterSkipped(Exception):
    """Stops a chapter that cannot run on this machine. IPython shows it as its one-line message."""

    def _render_traceback_(self):
        return [str(self)]


def installed(package: str) -> bool:
    """Whether `import package` can find it (without importing it: TensorFlow takes ~10 s)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package or a stub that refuses
        return False


def tensorflow_installed() -> bool:
    return installed("tensorflow")


def _skip(ledger, what: str, name: str = "TensorFlow") -> str:
    reason = f"{name} is not installed; to run it: {INSTALL_HINT}"
    ledger.skip(what, reason)
    return f"SKIPPED {what}: {reason}"


def have_tensorflow(ledger, section: str) -> bool:
    """True where TensorFlow is installed; else print one line, mark `section` skipped in the ledger, False."""
    if tensorflow_installed():
        return True
    print(_skip(ledger, section))
    return False


def have_package(ledger, package: str, section: str) -> bool:
    """`have_tensorflow` for another optional package (chapter 03's bitsandbytes, which a GPU machine's own
    environment may lack)."""
    if installed(package):
        return True
    print(_skip(ledger, section, package))
    return False


def require_tensorflow(ledger, chapter: str) -> None:
    """For a chapter that is all TensorFlow: without it, mark the chapter skipped and stop it (ChapterSkipped)."""
    if not tensorflow_installed():
        raise ChapterSkipped(_skip(ledger, chapter))
