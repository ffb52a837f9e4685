"""Hide TensorFlow (and Keras, which needs it) from this Python and everything it starts.

Put this folder on PYTHONPATH, as an absolute path: `PYTHONPATH=$PWD/tools/no_tensorflow make run` behaves like a machine
without TensorFlow (an offline GPU machine with torch only). `import tensorflow` raises
ModuleNotFoundError and `importlib.util.find_spec("tensorflow")` returns None, as they would if it were not
installed; papermill's kernels and torchrun's ranks inherit PYTHONPATH, so they see the same.
Used by tests/test_gpu_ready.py; course_lib/env.py (`have_tensorflow`) says what the chapters do then.
"""
import sys

for _name in ("tensorflow", "keras", "tf_keras"):
    sys.modules[_name] = None  # the import system's own "not importable" marker
