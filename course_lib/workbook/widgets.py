"""The memory calculator of chapter 00: pick a model and a setup, see the per-GPU bytes live.

    from course_lib.workbook.widgets import memory_calculator
    memory_calculator()

The arithmetic is `course_lib.memory.memory_plan` (the course's one memory model, `step_memory`); this module
only draws it (ipywidgets and
matplotlib are imported here, never by `import course_lib`). The browser test
(tests/test_browser.py) changes the inputs and reads the figure in the `memory-total` label.
"""
from __future__ import annotations

import html
import os

from ..memory import GB, OPTIMIZER_STATE_BYTES, PRECISIONS, memory_plan
from ..models import QWEN25

PARTS = ("params", "grads", "optimizer", "activations", "logits", "transient")
COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
          "logits": "#8172b3", "transient": "#bbbbbb"}


def plan_for(model: str, **setup) -> dict:
    """`memory_plan` for a named Qwen2.5 model (the calculator's inputs, minus the widgets)."""
    if model not in QWEN25:
        raise ValueError(f"unknown model {model!r}: choose one of {', '.join(QWEN25)}")
    return memory_plan(QWEN25[model], **setup)


def total_label(plan: dict) -> str:
    """The text the calculator shows, e.g. 'per GPU: peak 124.37 GB' (decimal GB, as the seeds quote): the step's
    high-water mark, what must fit."""
    return f"per GPU: peak {plan['peak'] / GB:.2f} GB"


def draw(plan: dict, ax, title: str = "") -> None:
    """One stacked bar of the plan's parts, in GB: what is held, what the forward keeps, and the step's transient
    peak on top (a negative transient, a peak in the optimizer step below the sum, is drawn as nothing)."""
    bottom = 0.0
    for part in PARTS:
        gb = max(0.0, plan[part]) / GB
        ax.bar([0], [gb], bottom=bottom, color=COLORS[part], label=f"{part} {gb:.1f} GB", width=0.5)
        bottom += gb
    ax.set_xticks([])
    ax.set_xlim(-0.6, 1.8)
    ax.set_ylabel("GB per GPU")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)


HEADLESS = "COURSE_HEADLESS"  # set for the kernels `make run` and the tests execute (course_lib.workbook.runner)


def memory_calculator(model: str = "Qwen2.5-7B"):
    """The interactive calculator: dropdowns and numbers in, a stacked bar and a total out. Executed headless
    (`make run`: no one to move a dropdown), its default setup drawn once instead: nbclient can wait forever on
    a cell that opens widgets, with the kernel idle (a hang seen in `make test`, known upstream)."""
    import matplotlib.pyplot as plt

    if os.environ.get(HEADLESS):
        plan = plan_for(model, precision="bf16-mixed", optimizer="adamw", zero_stage=0, ranks=1, seq=2048, batch=1,
                        checkpointing=False)
        fig, ax = plt.subplots(figsize=(5, 4))
        draw(plan, ax, f"{model}, bf16-mixed, ZeRO-0 (open the notebook in JupyterLab to change the setup)")
        plt.show()
        plt.close(fig)
        print(total_label(plan))
        return None
    import ipywidgets as W

    style = {"description_width": "110px"}
    inputs = {
        "model": W.Dropdown(options=list(QWEN25), value=model, description="model", style=style),
        "precision": W.Dropdown(options=PRECISIONS, value="bf16-mixed", description="precision", style=style),
        "optimizer": W.Dropdown(options=list(OPTIMIZER_STATE_BYTES), value="adamw", description="optimizer", style=style),
        "zero_stage": W.Dropdown(options=[0, 1, 2, 3], value=0, description="ZeRO stage", style=style),
        "ranks": W.BoundedIntText(value=1, min=1, max=4096, description="GPUs (ranks)", style=style),
        "seq": W.BoundedIntText(value=2048, min=1, max=1_000_000, description="sequence", style=style),
        "batch": W.BoundedIntText(value=1, min=1, max=4096, description="micro-batch", style=style),
        "checkpointing": W.Checkbox(value=False, description="activation checkpointing", style=style),
    }
    for name, widget in inputs.items():
        widget.add_class(f"calc-{name.replace('_', '-')}")
    total = W.HTML()
    total.add_class("memory-total")
    out = W.Output()

    def update(_=None):
        try:
            setup = {k: w.value for k, w in inputs.items()}
            plan = plan_for(setup.pop("model"), **setup)
        except ValueError as e:
            total.value = f"<b style='color:#b00020'>error: {html.escape(str(e))}</b>"
            return
        total.value = f"<b>{total_label(plan)}</b>"
        with out:
            out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(5, 4))
            draw(plan, ax, f"{inputs['model'].value}, {inputs['precision'].value}, ZeRO-{inputs['zero_stage'].value}")
            plt.show()
            plt.close(fig)

    for widget in inputs.values():
        widget.observe(update, names="value")
    update()
    return W.HBox([W.VBox([*inputs.values(), total]), out])
