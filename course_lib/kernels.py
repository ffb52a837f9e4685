"""Kernels for the runner (course_lib/runner.py): the arguments each chapter's kernel starts with, and a kernel
started ahead of its chapter.

The gpu profile starts the next chapter's kernel, its imports done, while the chapters before it run: kernel start-up
and imports (~10 s a chapter: torch and transformers import in 8-9 s on a 2-vCPU Xeon) leave the GPU's path. Not the
cpu profile's way: its cores are all busy with the chapters themselves.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

KERNEL_ARGS = ["--IPKernelApp.log_level=ERROR"]  # its "running over TCP" notice, once per chapter, is not an error
WARM_IMPORTS = "import torch, transformers, matplotlib.pyplot, course_lib"
# ... and what a chapter imports first thing beside those (presets.WARM_MORE_S): chapter 02, TensorFlow and Keras as
# its first cell does. Chapters 03, 05 and 08 import TensorFlow later, some after hiding devices from it: not ahead.
WARM_MORE = {"02_mixed_precision_keras": "import importlib.util, os\nif importlib.util.find_spec('tensorflow'):\n"
             "    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')\n    course_lib.env.import_tensorflow()\n    import keras"}


def warm_kernel(notebook: Path):
    """A kernel for `notebook`, started now in its folder with its COURSE_CHAPTER, WARM_IMPORTS (and its WARM_MORE)
    done, not in the chapter's history; `execute(..., km=...)` runs the chapter on it later. None, and a line, if
    that fails: the chapter then starts its own kernel."""
    from jupyter_client.manager import KernelManager

    km = None
    try:
        km = KernelManager(kernel_name=json.loads(notebook.read_text())["metadata"]["kernelspec"]["name"])
        km.start_kernel(extra_arguments=KERNEL_ARGS, cwd=str(notebook.parent),
                        env={**os.environ, "COURSE_CHAPTER": notebook.stem})
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=120)
            code = "\n".join([WARM_IMPORTS, WARM_MORE.get(notebook.stem, "")])
            reply = kc.execute_interactive(code, store_history=False, timeout=300)
        finally:
            kc.stop_channels()
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"{code!r}: {reply['content'].get('evalue')}")
        return km
    except Exception as e:  # noqa: BLE001  a faster start is not worth a failed chapter
        print(f"  {notebook.stem}: no kernel started ahead ({type(e).__name__}: {e}); it starts its own", flush=True)
        if km is not None and km.has_kernel:
            km.shutdown_kernel(now=True)
        return None
