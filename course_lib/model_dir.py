"""Checkpoint directories: a Qwen2.5 model on disk, real or made here, loaded one way.

A real Qwen2.5 checkpoint is a directory with `config.json`, `*.safetensors` weights and tokenizer files
(its `tokenizer_config.json` carries the chat template). The course makes directories of the same kind
(`make_tiny_checkpoint`: a tokenizer trained here and a tiny random-init `Qwen2ForCausalLM`, both written
with `save_pretrained`), so both kinds load through the same `from_pretrained` calls (`load_model`).
Introduced in chapter 09 (LoRA); used by chapter 10, the SFT recipe and its backends.
"""
from __future__ import annotations

import os
from pathlib import Path

from .tokenizer import TOKENIZER_FILES, train_tokenizer

MODEL_FILES = ("config.json",)


def check_model_dir(path) -> Path:
    """`path` as a Path if it holds a model and its tokenizer; else one clear error saying what is missing."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model_path {str(path)!r} is not a directory: expected a local Qwen2.5 checkpoint "
                                f"directory with config.json, *.safetensors weights and tokenizer files "
                                f"({', '.join(TOKENIZER_FILES)})")
    missing = [f for f in MODEL_FILES + TOKENIZER_FILES if not (path / f).is_file()]
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    if missing or not has_weights:
        missing += [] if has_weights else ["*.safetensors weights"]
        raise FileNotFoundError(f"model_path {str(path)!r} is not a complete checkpoint: missing "
                                f"{', '.join(missing)} (expected config.json, *.safetensors weights and tokenizer "
                                f"files {', '.join(TOKENIZER_FILES)}, as in a downloaded Qwen2.5 directory)")
    return path


def make_tiny_checkpoint(out_dir, texts, model: dict, vocab_size: int = 512, seed: int = 0) -> Path:
    """Train a tokenizer on `texts`, build a random-init tiny Qwen2 of shape `model` (its vocabulary
    sized to the tokenizer), and save both with `save_pretrained` into `out_dir`: a directory laid out
    like a downloaded Qwen2.5."""
    from .models import tiny_qwen2

    out_dir = Path(out_dir)
    tokenizer = train_tokenizer(texts, vocab_size)
    size = {**model, "vocab_size": len(tokenizer)}
    net = tiny_qwen2(seed=seed, **size)
    net.config.eos_token_id = tokenizer.eos_token_id
    net.config.pad_token_id = tokenizer.pad_token_id
    net.config.bos_token_id = None
    net.generation_config.eos_token_id = tokenizer.eos_token_id
    net.generation_config.pad_token_id = tokenizer.pad_token_id
    net.generation_config.bos_token_id = None
    out_dir.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_model(model_path, dtype=None):
    """(model, tokenizer) from a local checkpoint directory, offline, fp32 master weights by default.

    The same two `from_pretrained` calls load a real Qwen2.5 (any size) and the tiny checkpoint.
    transformers v5 would load Qwen2.5 in its stored bf16 (`dtype="auto"`): training keeps fp32.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = check_model_dir(model_path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.use_cache = False
    return model, tokenizer
