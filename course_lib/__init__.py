"""course_lib: the helper library of the workbook. Import it one way everywhere:

    import course_lib as cl

and reach every module as `cl.<module>` (the heavier ones load on first use). README's "Layout" lists
them; each module's docstring names the chapter that explains it. Importing it stays light: no
TensorFlow, IPython or ipywidgets here (recipes run on cluster nodes without them).
"""
import importlib

from . import config, dist, env, memory, models, precision, train
from .env import hardware_report, native_bf16, pick_device, seed_everything, set_threads, supports_bf16, supports_fp16
from .launch import LaunchError, launch, recipe
from .live_memory import LiveTensorBytes
from .measure import SavedTensors, cuda_peak, cuda_peak_bytes, model_state_bytes, peak_rss_bytes, tensor_bytes
from .presets import preset
from .results import Ledger, save_figure
from .timing import Timer, flops_per_token, mfu, time_it, tokens_per_second

# Modules loaded on first use (`cl.zero` imports nothing of DeepSpeed until a function needs it, but
# these pull in datasets, transformers or torch.distributed.checkpoint, which a chapter may never need).
_LAZY = {"backends", "fsdp2", "capstone", "checkpoint", "data", "evaluation", "exercises", "launch_errors",
         "model_dir", "runner", "report", "tokenizer", "zero", "data_parallel", "tensor_parallel", "pipeline_parallel",
         "keras_precision", "widgets", "lab", "paths", "losses", "comm", "speed", "bench"}


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'course_lib' has no attribute {name!r}")


__all__ = [
    "config", "dist", "env", "memory", "models", "precision", "train", "hardware_report", "native_bf16", "pick_device",
    "seed_everything", "set_threads", "supports_bf16", "supports_fp16", "LaunchError", "launch", "recipe",
    "LiveTensorBytes", "SavedTensors", "cuda_peak", "cuda_peak_bytes", "model_state_bytes", "peak_rss_bytes", "tensor_bytes", "preset",
    "Ledger", "save_figure", "Timer", "flops_per_token", "mfu", "time_it", "tokens_per_second",
]
