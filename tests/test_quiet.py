"""Quiet outputs at their source: the environment kernels and ranks get, the deepspeed launcher's log
level, progress bars off when the runner says so, TensorFlow imported without its banner. The executed notebooks
themselves are checked in tests/test_notebooks.py."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import course_lib as cl
from course_lib.workbook import runner
from course_lib.workbook.launch import _TEARDOWN, build_command


def test_quiet_env_filters_deprecations_and_respects_what_is_set():
    env = cl.env.quiet_env({})
    assert "ignore::FutureWarning" in env["PYTHONWARNINGS"] and "ignore::DeprecationWarning" in env["PYTHONWARNINGS"]
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "2"
    assert cl.env.quiet_env({"PYTHONWARNINGS": "default"}).get("PYTHONWARNINGS") is None  # the user's choice wins


def test_a_rank_started_quiet_prints_no_library_deprecation_warning():
    code = "import warnings; warnings.warn('old API', FutureWarning); warnings.warn('kept', UserWarning)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **cl.env.quiet_env({})}, timeout=60)
    assert "FutureWarning" not in done.stderr and "kept" in done.stderr  # other warnings still show


def test_the_deepspeed_launcher_runs_at_warning_level():
    command = build_command(Path("x.py"), ["--a"], 2, "deepspeed", 29500)
    assert "--log_level=warning" in command and command.index("--log_level=warning") < command.index("x.py")
    assert _TEARDOWN.search("[2026] [ERROR] [launch.py:259:sigkill_handler] ['python', 'x.py'] exits with "
                                   "return code = 1")


def test_the_runner_keeps_bars_and_kernel_notices_out():
    assert runner.HEADLESS_ENV["TQDM_DISABLE"] == "1" and "--IPKernelApp.log_level=ERROR" in runner.KERNEL_ARGS


def test_progress_bar_is_off_when_tqdm_disable_is_set(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert cl.env.progress_bar(range(3)).disable
    monkeypatch.delenv("TQDM_DISABLE")
    bar = cl.env.progress_bar(range(3), file=open("/dev/null", "w"))
    assert not bar.disable
    bar.close()


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="SKIPPED: TensorFlow is not installed")
@pytest.mark.timeout(300)
def test_tensorflow_imports_without_its_banner():
    done = subprocess.run([sys.executable, "-c", "import course_lib as cl; tf = cl.env.import_tensorflow(); print(tf.__name__)"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "tensorflow", done.stderr[-1000:]
    assert "oneDNN custom operations" not in done.stderr


def test_the_deepspeed_launchers_hostfile_notice_is_kept_but_not_printed():
    from course_lib.workbook.launch import Run, _Printer

    shown, run = [], Run(["x"])
    printer = _Printer(run, quiet=False, emit=shown.append)
    printer.feed(b"[2026-12-05 10:00:00,000] [WARNING] [runner.py:214:fetch_hostfile] Unable to find hostfile, will "
                 b"proceed with training with local resources only.\n[rank0]: real output\n")
    assert len(run.lines) == 2 and shown == ["[rank 0] real output"]


def test_bitsandbytes_kernel_hub_warning_is_dropped_and_its_other_messages_kept(caplog):
    import logging

    cl.env.quiet_library_loggers()   # idempotent: `import course_lib` installed it already
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "Set trust_remote_code=True")
        logger.warning("another message")
    assert [r.getMessage() for r in caplog.records] == ["another message"]
    assert sum(type(f).__name__ == "_DropMessage" for f in logger.filters) == 1


def test_trainers_compile_notice_on_a_machine_without_ampere_is_dropped():
    """Trainer with torch_compile on a CPU (the benchmark's) warns that compiling speeds up mostly on Ampere GPUs:
    the notice is dropped where transformers logs it; the settings are built as asked."""
    import logging

    from course_lib.recipes import sft, sft_trainer

    seen = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("transformers.training_args")  # (transformers' loggers do not propagate to the root)
    logger.addHandler(handler)
    try:
        cfg = sft_trainer.from_sft(sft.Config(model_path="m", data_dir="d", out_dir="o"), torch_compile=True)
        args = sft_trainer.training_arguments(cfg, bf16=False)
        logger.warning("another message")
    finally:
        logger.removeHandler(handler)
    assert args.torch_compile and not any("torchdynamo" in m for m in seen) and "another message" in seen
