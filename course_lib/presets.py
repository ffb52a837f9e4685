"""Presets: the sizes each profile runs at, as plain data (in the spirit of nanoGPT's configs).

A notebook's `parameters` cell names a profile (and may override single knobs); it then calls

    P = cl.preset(profile, chapter="03", steps=steps)    # None means "take the preset's value"

and reads `P.model`, `P.seq_len`, `P.steps`, ... The `cpu` profile runs on a 2-core laptop or CI
runner in minutes; `gpu` uses real sizes on one modern GPU (the Docker image, chapter README).
A knob enters once, here or in the parameters cell, and travels one way from there.
"""
from __future__ import annotations

from types import SimpleNamespace

TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=512, vocab_size=1024, tie_word_embeddings=True)
# Qwen2.5-0.5B's shape, random init (chapters 09-10 load the real weights when `model_path` is given)
QWEN25_05B_SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)

PRESETS = {
    "cpu": {
        "device": "cpu",
        "nproc": 2,  # ranks for distributed chapters (gloo)
        "model": TINY,
        "seq_len": 128,
        "batch_size": 8,
        "seed": 0,
        "chapters": {
            "00": dict(act_seq_len=256, act_batch=4),
            "01": dict(steps=40, time_repeat=3),
            "02": dict(steps=60, epochs=3, tf_samples=4096),
            "03": dict(time_repeat=3),
            "04": dict(steps=60, accum_steps=4),
            "05": dict(steps=5),
            "06": dict(steps=4),
            "07": dict(steps=4),
            "08": dict(micro_batches=(1, 2, 4, 8), micro_batch_size=2, pp_layers=8, pp_vocab_size=256, pp_repeats=3,
                       tp_meshes=None),
            "09": dict(steps=300),
            "10": dict(steps=500),
            "11": dict(steps=5),
            "12": dict(steps=3),
        },
    },
    "gpu": {
        "device": "cuda",
        "nproc": 1,  # set to the GPUs you have; `cl.launch` checks it fits
        "model": QWEN25_05B_SHAPE,
        "seq_len": 1024,
        "batch_size": 8,
        "seed": 0,
        "chapters": {
            "00": dict(act_seq_len=1024, act_batch=4),
            "01": dict(steps=100, time_repeat=5),
            "02": dict(steps=200, epochs=5, tf_samples=60000),
            "03": dict(time_repeat=5),
            "04": dict(steps=200, accum_steps=4),
            "05": dict(steps=20),
            "06": dict(steps=10),
            "07": dict(steps=10),
            "08": dict(micro_batches=(1, 2, 4, 8, 16), micro_batch_size=4, pp_layers=None, pp_vocab_size=None,
                       pp_repeats=5, tp_meshes=None),
            "09": dict(steps=500),
            "10": dict(steps=1000),
            "11": dict(steps=10),
            "12": dict(steps=5),
        },
    },
}


def detect_profile() -> str:
    """`gpu` when CUDA is available, else `cpu` (what `profile="auto"` resolves to)."""
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def preset(profile: str = "auto", chapter: str | None = None, **overrides) -> SimpleNamespace:
    """The settings of `profile` (plus one chapter's block), with non-None `overrides` applied."""
    name = detect_profile() if profile == "auto" else profile
    if name not in PRESETS:
        raise ValueError(f"unknown profile {profile!r}: choose one of auto, {', '.join(PRESETS)}")
    base = {k: v for k, v in PRESETS[name].items() if k != "chapters"}
    if chapter is not None:
        chapters = PRESETS[name]["chapters"]
        if chapter not in chapters:
            raise ValueError(f"no preset for chapter {chapter!r}: known chapters are {', '.join(chapters)}")
        base.update(chapters[chapter])
    for key, value in overrides.items():
        if key not in base:
            raise ValueError(f"unknown knob {key!r} for profile {name!r}: known knobs are {', '.join(sorted(base))}")
        if value is not None:
            base[key] = value
    base["model"] = dict(base["model"])
    return SimpleNamespace(name=name, **base)
