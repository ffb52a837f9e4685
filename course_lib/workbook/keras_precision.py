"""Mixed precision in TensorFlow/Keras 3: a dtype audit of a model, and the policy set for one block.

Chapter 02 ("Mixed precision in TensorFlow / Keras 3") explains and uses these. This module imports
TensorFlow, so `course_lib/__init__.py` does not import it: use `from course_lib.workbook import keras_precision`.

    audit = keras_precision.dtype_audit(model)    # one row per layer; row["flags"] lists what looks wrong
    keras_precision.print_audit(audit)
"""
from __future__ import annotations

from contextlib import contextmanager

import keras
import tensorflow as tf  # noqa: F401  (the backend these helpers are written for)

SIXTEEN = ("float16", "bfloat16")
_PROB_ACTIVATIONS = ("softmax", "sigmoid", "log_softmax")


def quiet_fp16_notice() -> None:
    """Run one tiny float16 matmul on the CPU with the process's stderr pointed at /dev/null. On a CPU without
    AVX-512-FP16 (or AMX-FP16), TensorFlow's oneDNN build logs, once per process and at ERROR level, "oneDNN supports
    DT_HALF only on platforms with AVX-512. Falling back to the default Eigen-based implementation": not an error,
    only the news that fp16 runs in TensorFlow's own kernels (chapter 02 measures them). TF_CPP_MIN_LOG_LEVEL does not
    reach that line; this spends its once here. Errors of the matmul itself still raise. Call it after the thread
    settings (it starts TensorFlow's runtime)."""
    from ..env import native_stderr_silenced

    with native_stderr_silenced(), tf.device("/CPU:0"):
        tf.linalg.matmul(tf.ones((2, 2), tf.float16), tf.ones((2, 2), tf.float16)).numpy()


def _activation_name(layer) -> str | None:
    if isinstance(layer, keras.layers.Softmax):
        return "softmax"
    act = getattr(layer, "activation", None)
    return getattr(act, "__name__", None) if act is not None else None


def dtype_audit(model: keras.Model) -> list[dict]:
    """Each layer's compute and variable dtype, with flags for what silently runs in 16-bit (the Keras
    mixed-precision article's "dtype consistency check"):

    - `16-bit weights`: variables stored in 16-bit (a layer built with dtype="float16", not a mixed
      policy): no fp32 master copy, small updates round away;
    - `16-bit output`: the model's output layer computes in 16-bit: logits/probabilities rounded,
      and fp16 overflows past 65504; give it dtype="float32";
    - `16-bit softmax`: a softmax/sigmoid computed in 16-bit anywhere.
    The input layer is skipped.
    """
    outputs = {id(t) for t in tf.nest.flatten(model.outputs)} if getattr(model, "outputs", None) else set()
    rows = []
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    for i, layer in enumerate(layers):
        compute, variable = layer.compute_dtype, layer.variable_dtype
        try:
            is_output = id(layer.output) in outputs if outputs else i == len(layers) - 1
        except (AttributeError, ValueError):  # a layer never called inside a functional graph
            is_output = i == len(layers) - 1
        flags = []
        if layer.weights and any(w.dtype in SIXTEEN for w in layer.weights):
            flags.append("16-bit weights")
        if is_output and compute in SIXTEEN:
            flags.append("16-bit output")
        if _activation_name(layer) in _PROB_ACTIVATIONS and compute in SIXTEEN:
            flags.append(f"16-bit {_activation_name(layer)}")
        rows.append({"layer": layer.name, "class": type(layer).__name__, "policy": layer.dtype_policy.name,
                     "compute": compute, "variables": variable, "output": is_output, "flags": flags})
    return rows


def print_audit(rows: list[dict]) -> None:
    """The audit as a table; flagged layers marked with `!!`."""
    print(f"{'':2s} {'layer':24s} {'class':20s} {'policy':16s} {'compute':9s} {'variables':9s} flags")
    for r in rows:
        mark = "!!" if r["flags"] else ""
        print(f"{mark:2s} {r['layer'][:24]:24s} {r['class'][:20]:20s} {r['policy'][:16]:16s} {r['compute']:9s} "
              f"{r['variables']:9s} {', '.join(r['flags'])}")


@contextmanager
def dtype_policy(name: str):
    """`with dtype_policy("mixed_float16"): model = build()`: the global policy for the layers built inside,
    restored afterwards (the global setting otherwise leaks into every later cell)."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)
