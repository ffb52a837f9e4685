"""course_lib: the helper library of the workbook. Import it one way everywhere:

    import course_lib as cl

Modules, each named for its concern and pointing to the chapter that explains it:
env (device, seeds, hardware report), presets (cpu/gpu sizes), results (the ledger), memory (theory),
measure (what is actually held), timing (timer, tokens/s, MFU), models (Qwen2 configs), train (loop pieces),
launch + dist (distributed recipes), runner + report (headless execution), widgets (the calculator).
Importing it stays light: no TensorFlow, IPython or ipywidgets here (recipes run on cluster nodes).
"""
from . import dist, memory, models, precision, train
from .env import hardware_report, native_bf16, pick_device, seed_everything, set_threads, supports_bf16, supports_fp16
from .launch import LaunchError, launch, recipe
from .measure import SavedTensors, cuda_peak, cuda_peak_bytes, model_state_bytes, peak_rss_bytes, tensor_bytes
from .presets import preset
from .results import Ledger, save_figure
from .timing import Timer, flops_per_token, mfu, time_it, tokens_per_second

__all__ = [
    "dist", "memory", "models", "train", "hardware_report", "native_bf16", "pick_device", "seed_everything", "set_threads",
    "supports_bf16", "supports_fp16", "LaunchError", "launch", "recipe", "SavedTensors", "cuda_peak", "cuda_peak_bytes",
    "model_state_bytes", "peak_rss_bytes", "tensor_bytes", "preset", "Ledger", "save_figure", "Timer",
    "flops_per_token", "mfu", "time_it", "tokens_per_second",
]
