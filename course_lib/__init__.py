"""course_lib: the helper library of the workbook. Import it one way everywhere:

    import course_lib as cl

and reach every module by its short name, `cl.<module>` (`cl.memory`, `cl.zero`, `cl.data`, `cl.exercises`),
wherever it sits in the folders (README's "Layout": memory/, parallel/, sft/, workbook/, recipes/); each
module's docstring names the chapter that explains it. Importing it stays light: no TensorFlow, IPython or
ipywidgets here (recipes run on cluster nodes without them), and nothing of the workbook (notebook-side code):
a rank that imports course_lib loads only what runs in a rank.
"""
import importlib

from . import config, env, memory, models, presets, timing
from .env import hardware_report, native_bf16, pick_device, seed_everything, set_threads, supports_bf16, supports_fp16
from .memory.live_memory import LiveTensorBytes
from .memory.measure import SavedTensors, cuda_peak, cuda_peak_bytes, model_state_bytes, peak_rss_bytes, tensor_bytes
from .parallel import dist, precision
from .presets import preset, setup
from .sft import train
from .timing import Timer, flops_per_token, mfu, time_it, tokens_per_second

# The other modules, by the short name a notebook uses, loaded on first use: `cl.zero` imports nothing of
# DeepSpeed until a function needs it, but these pull in datasets, transformers, torch.distributed.checkpoint or
# the workbook, which a chapter (or a rank) may never need.
MODULES = {
    "measure": "memory.measure", "live_memory": "memory.live_memory", "losses": "memory.losses",
    "comm": "parallel.comm", "data_parallel": "parallel.data_parallel", "fsdp2": "parallel.fsdp2",
    "pipeline_parallel": "parallel.pipeline_parallel", "tensor_parallel": "parallel.tensor_parallel", "zero": "parallel.zero",
    "backends": "sft.backends", "capstone": "sft.capstone", "checkpoint": "sft.checkpoint", "data": "sft.data",
    "evaluation": "sft.evaluation", "model_dir": "sft.model_dir", "speed": "sft.speed", "tokenizer": "sft.tokenizer",
    "bench": "workbook.bench", "book": "workbook.book", "exercises": "workbook.exercises",
    "keras_precision": "workbook.keras_precision", "lab": "workbook.lab", "launch_errors": "workbook.launch_errors",
    "report": "workbook.report", "results": "workbook.results", "runner": "workbook.runner", "widgets": "workbook.widgets",
    "paths": "paths",
}
# Names of the workbook's at the top, also loaded on first use: `cl.launch` is the function (its module:
# course_lib.workbook.launch).
NAMES = {"Ledger": "workbook.results", "save_figure": "workbook.results", "launch": "workbook.launch",
         "recipe": "workbook.launch", "LaunchError": "workbook.launch"}


def __getattr__(name: str):
    if name in MODULES:
        value = importlib.import_module(f".{MODULES[name]}", __name__)
    elif name in NAMES:
        value = getattr(importlib.import_module(f".{NAMES[name]}", __name__), name)
    else:
        raise AttributeError(f"module 'course_lib' has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = [
    "config", "dist", "env", "memory", "models", "precision", "presets", "timing", "train", "hardware_report",
    "native_bf16", "pick_device", "seed_everything", "set_threads", "supports_bf16", "supports_fp16", "LaunchError",
    "launch", "recipe", "LiveTensorBytes", "SavedTensors", "cuda_peak", "cuda_peak_bytes", "model_state_bytes",
    "peak_rss_bytes", "tensor_bytes", "preset", "setup", "Ledger", "save_figure", "Timer", "flops_per_token", "mfu",
    "time_it", "tokens_per_second",
]
