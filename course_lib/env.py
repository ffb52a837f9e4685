"""The machine the course runs on: device, 16-bit support, seeds, a one-screen hardware report, and the optional
packages it may lack (a section that needs one skips in one line).

Defined in chapter 00 ("Where does the memory go?"); every chapter starts with `cl.hardware_report()`.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import random
import sys
from contextlib import contextmanager
from importlib import metadata

import numpy as np
import torch


# What the cpu profile's kernels and ranks run with on any machine (the runner sets it): no GPU in sight, so one
# code path (gloo, CPU tensors, nproc ranks on cores) whatever the machine has.
CPU_PROFILE_ENV = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}


def gpus_hidden(environ=None) -> bool:
    """`environ` (default: this process's) hides every GPU: CUDA_VISIBLE_DEVICES set empty or to -1."""
    return (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES") in ("", "-1")


def cuda_usable() -> bool:
    """CUDA is present and not hidden: an explicit empty CUDA_VISIBLE_DEVICES (the cpu profile) wins even where
    CUDA was initialized before it was set."""
    return not gpus_hidden() and torch.cuda.is_available()


@contextmanager
def environ(**values):
    """These environment variables inside the block (None: unset); what was there before is restored after."""
    saved = {k: os.environ.get(k) for k in values}
    def put(items):
        for k, v in items:
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    put(values.items())
    try:
        yield
    finally:
        put(saved.items())


def deepspeed_told_no_gpu() -> None:
    """On a machine without a GPU, DS_ACCELERATOR=cpu (unless set): transformers imports DeepSpeed wherever it is
    installed (accelerate looks for its engine class), and DeepSpeed, looking for a GPU, warns that it found none.
    The commands call it first (the recipe, Trainer's, the benchmark)."""
    if not cuda_count():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def cpu_only():
    """The cpu profile's view inside this block, in this process: `cuda_usable()` is False, so a recipe run here
    takes the CPU as its ranks do under `CPU_PROFILE_ENV` (chapter 11, on one GPU, measures its CPU ranks' reference
    this way). The environment is restored after."""
    return environ(**CPU_PROFILE_ENV)


def pick_device() -> torch.device:
    """The best device here: CUDA when present and not hidden, else the CPU (never fails, like d2l's `try_gpu`)."""
    return torch.device("cuda" if cuda_usable() else "cpu")


def deterministic(device: torch.device | str | None = None) -> None:
    """Bitwise-repeatable runs on a GPU, for the exact-resume checks (chapters 06 and 10): cuBLAS's fixed
    workspace (read when CUDA creates its cuBLAS handle: call before any CUDA work) and deterministic algorithms
    where torch has them. The CPU kernels already repeat: a no-op there."""
    if torch.device(device or pick_device()).type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


def supports_bf16(device: torch.device | str | None = None) -> bool:
    """Whether bf16 *runs* on `device` (CPU autocast always runs; it may be slow, see `native_bf16`)."""
    device = torch.device(device or pick_device())
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return True


def native_bf16(device: torch.device | str | None = None) -> bool:
    """Whether bf16 is *fast* on `device`: Ampere+ GPUs, or CPUs with AVX-512-BF16/AMX.

    Chapter 01 measures what happens without it: on an AVX2-only CPU, bf16 is many times slower.
    """
    device = torch.device(device or pick_device())
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported() and torch.cuda.get_device_capability(device)[0] >= 8
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def supports_fp16(device: torch.device | str | None = None) -> bool:
    """fp16 with loss scaling is a GPU technique; DeepSpeed refuses it on CPU (chapter 06)."""
    return torch.device(device or pick_device()).type == "cuda"


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and torch (all devices) so a chapter's figures repeat run to run."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask), not the machine's total: the one answer
    the course uses for "how many cores" (threads per rank, ranks per machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def rank_threads(nproc: int, cores: int, beside_gpu: bool = False) -> int:
    """Threads for each of `nproc` CPU ranks on `cores` cores: the cores divided among them (2 ranks on 2 cores do
    not oversubscribe them); on a GPU host whose GPU they do not use (`cl.presets.ranks_plan` on one GPU), one each,
    as the cpu profile's ranks run on its 2 cores. There, the ranks share the host with the chapter on the GPU (a
    16-core host: 8 threads a rank would take every core from it), and tiny ops at the cpu sizes gain nothing
    from more threads."""
    return 1 if beside_gpu else max(1, cores // nproc)


def cuda_count() -> int:
    return torch.cuda.device_count() if cuda_usable() else 0


def max_ranks() -> int:
    """How many ranks this machine can run: one per GPU, or one per CPU core without GPUs."""
    return cuda_count() or cpu_cores()


def resolve_nproc(nproc) -> int:
    """A preset's or a notebook's `nproc`: a number of ranks, or "all" (one per GPU, else per core)."""
    if nproc == "all":
        return max_ranks()
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a whole number >= 1 or 'all', got {nproc!r}")
    return nproc


# Library chatter, kept out of the notebooks, the ranks' output and `make run`'s console at its source:
# the libraries' deprecation warnings (torch.distributed's FutureWarnings alone filled half of chapter 06) and
# TensorFlow's C++ INFO/WARNING lines. Errors, and every other warning, still show.
QUIET_ENV = {"PYTHONWARNINGS": "ignore::DeprecationWarning,ignore::FutureWarning", "TF_CPP_MIN_LOG_LEVEL": "2"}

# bitsandbytes >= 0.49, imported on a CPU with AVX-512-BF16, tries to fetch a 4-bit matmul kernel from the Hugging Face
# kernel hub, fails (the hub refuses an unverified publisher unless the user passes trust_remote_code), falls back to
# its own CPU kernel and logs a warning that suggests `trust_remote_code=True`. The fallback is what the course runs
# (nothing here uses 4-bit matmuls on a CPU), and running remote code is no advice to pass on: that one message is
# dropped, wherever bitsandbytes is imported (chapters 03, 09, 11; peft imports it too). Its other messages still show.
_BNB_KERNEL_HUB = ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward")
# transformers, asked for `torch_compile` where there is no Ampere GPU (the benchmark's Trainer on a CPU), warns that
# compiling speeds up mostly on such GPUs: the benchmark measures what it does on the machine at hand.
_DYNAMO_GPU_NOTICE = ("transformers.training_args", "The speedups for torchdynamo mostly come with GPU Ampere")


class _DropMessage:
    """A logging filter that drops the records whose message template starts with `prefix`."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_library_loggers() -> None:
    """Install the filters above (idempotent); `import course_lib` calls it, before any library logs."""
    import logging

    for name, prefix in (_BNB_KERNEL_HUB, _DYNAMO_GPU_NOTICE):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(prefix))


quiet_library_loggers()


def quiet_env(environ: dict | None = None) -> dict:
    """The variables a kernel or a rank gets to stay quiet: `QUIET_ENV` (what `environ` already sets wins), plus
    DS_ACCELERATOR=cpu without a GPU (DeepSpeed then skips its "unable to detect a GPU" warning). Used by the
    runner (kernels) and `cl.launch` (ranks)."""
    environ = os.environ if environ is None else environ
    wanted = {**QUIET_ENV, **({} if cuda_count() else {"DS_ACCELERATOR": "cpu"})}
    return {k: v for k, v in wanted.items() if k not in environ}


@contextmanager
def native_stderr_silenced():
    """Point file descriptor 2 at /dev/null for a moment: for what C++ libraries write there directly, before
    any logging setting of theirs applies (kineto's profiler lines, TensorFlow's start-up banner)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def progress_bar(iterable=None, **kwargs):
    """`tqdm.auto.tqdm`: a progress widget in JupyterLab, none when TQDM_DISABLE is set (as `make run` and the
    tests set it, so executed notebooks keep no bars; tqdm's notebook bar ignores that variable by itself)."""
    from tqdm.auto import tqdm

    kwargs.setdefault("disable", os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes"))
    return tqdm(iterable, **kwargs)


def import_tensorflow():
    """`import tensorflow as tf`, without the "oneDNN custom operations are on" banner its C++ runtime prints
    twice while loading (TensorFlow 2.21 writes it before its log level applies; TF_CPP_MIN_LOG_LEVEL cannot
    stop it). Errors still raise. Chapters 02, 05 and 08; import Keras after it."""
    with native_stderr_silenced():
        import tensorflow as tf
    return tf


# --- optional packages ---------------------------------------------------------------------------------------
# TensorFlow is optional at run time: its sections skip, in one line, where it is not installed.
#
# The default install has TensorFlow (the `cpu` and `gpu` extras), but a machine may not: a bare CUDA box
# with only PyTorch, a torch-only environment. The TensorFlow parts of chapters 02, 03, 05 and 08 then say
# what they skip and how to install it, and the ledger marks them `skipped`, not failed (`have_package` does the
# same for another optional package, such as chapter 03's bitsandbytes):
#
#     from course_lib.env import have_tensorflow, require_tensorflow
#
#     if have_tensorflow(ledger, "section 6, tf.recompute_grad"):   # False: one line printed, ledger says skipped
#         ...
#     require_tensorflow(ledger, "chapter 02")   # a chapter that is all TensorFlow: stops here (ChapterSkipped)
#
# The runner (course_lib/workbook/runner.py) counts a chapter stopped by ChapterSkipped as `skipped`, and the report shows
# skipped entries as such. To try it on a machine that has TensorFlow, hide it: put `tools/no_tensorflow` first
# on PYTHONPATH (tests/test_gpu_ready.py does).
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


def set_threads(n: int | None = None) -> int:
    """Pin torch's intra-op threads (default: all cores). Oversubscribed cores make timings lie."""
    n = n or cpu_cores()
    torch.set_num_threads(n)
    return n


def total_ram_bytes() -> int:
    import psutil

    return psutil.virtual_memory().total


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "-"


def hardware_report(show: bool = True) -> dict:
    """CPU cores, RAM, GPU name and memory, and the versions of the libraries the course uses."""
    info = {
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": cpu_cores(),
        "ram_gib": round(total_ram_bytes() / 2**30, 1),
        "device": str(pick_device()),
        "gpu": None,
        "gpu_mem_gib": None,
        "bf16_native": native_bf16(),
    }
    if cuda_usable():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=f"{props.name} x{torch.cuda.device_count()}", gpu_mem_gib=round(props.total_memory / 2**30, 1))
    for pkg in ("torch", "transformers", "peft", "deepspeed", "accelerate", "tensorflow-cpu", "tensorflow", "keras"):
        v = _version(pkg)
        if v != "-":
            info[pkg] = v
    if show:
        width = max(map(len, info))
        for k, v in info.items():
            print(f"{k:<{width}}  {v}")
    return info
