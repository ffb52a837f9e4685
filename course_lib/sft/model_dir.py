"""Checkpoint directories: a Qwen2.5 model on disk, real or made here, loaded one way.

A real Qwen2.5 checkpoint is a directory with `config.json`, `*.safetensors` weights and tokenizer files
(its `tokenizer_config.json` carries the chat template). The course makes directories of the same kind
(`make_tiny_checkpoint`: a tokenizer trained here and a tiny random-init `Qwen2ForCausalLM`, both written
with `save_pretrained`), so both kinds load through the same `from_pretrained` calls (`load_model`).
Introduced in chapter 09 (LoRA); used by chapter 10, the SFT recipe and its backends.
"""
from __future__ import annotations

import json
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
    for weights in sorted(path.glob("*.safetensors")):
        check_safetensors(weights)
    return path


def check_safetensors(path: Path) -> None:
    """One clear error for a `.safetensors` file cut short (an interrupted download or copy): its header says where
    each tensor's bytes end; the file must reach the last of them. Reads the header only."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(n)) if 0 < n <= size - 8 else None
        except ValueError:
            header = None
    ends = [t["data_offsets"][1] for k, t in (header or {}).items() if k != "__metadata__"]
    if header is None or 8 + n + max(ends, default=0) > size:
        raise FileNotFoundError(f"{path} is cut short ({size:,} bytes, fewer than its header describes): download or "
                                f"copy it again")


def _save(out_dir: Path, net, tokenizer) -> Path:
    """Write `net` and `tokenizer` like a downloaded checkpoint (generation stops at the end-of-turn token)."""
    for cfg in (net.config, net.generation_config):
        cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id, None
    out_dir.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def make_tiny_checkpoint(out_dir, texts, model: dict, vocab_size: int = 512, seed: int = 0) -> Path:
    """Train a tokenizer on `texts`, build a random-init tiny Qwen2 of shape `model` (its vocabulary
    sized to the tokenizer), and save both with `save_pretrained` into `out_dir`: a directory laid out
    like a downloaded Qwen2.5."""
    from ..models import tiny_qwen2

    tokenizer = train_tokenizer(texts, vocab_size)
    net = tiny_qwen2(seed=seed, **{**model, "vocab_size": len(tokenizer)})
    return _save(Path(out_dir), net, tokenizer)


def make_checkpoint(out_dir, tokenizer_dir, shape: dict, seed: int = 0) -> Path:
    """A random-init Qwen2 of a real `shape` (e.g. `cl.models.QWEN25["Qwen2.5-0.5B"]`: 494M parameters) with a
    real tokenizer (e.g. `cl.tokenizer.fetch_qwen_tokenizer`), saved in bf16 safetensors as Qwen2.5 ships:
    the layout, sizes and loading path of a downloaded checkpoint, without downloading one. A directory that
    already holds it (same shape and tokenizer) is kept. Built straight in bf16: ~1 GB for 0.5B, ~15 s."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from ..models import qwen2_config

    out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    stamp = {"shape": shape, "seed": seed, "tokenizer": str(tokenizer_dir.resolve())}
    if (out_dir / "made.json").is_file() and json.loads((out_dir / "made.json").read_text()) == stamp:
        return out_dir
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if len(tokenizer) > shape["vocab_size"]:
        raise ValueError(f"the tokenizer has {len(tokenizer):,} tokens, more than the shape's vocabulary "
                         f"{shape['vocab_size']:,}")
    torch.manual_seed(seed)
    net = Qwen2ForCausalLM._from_config(qwen2_config(**shape, max_position_embeddings=32768), dtype=torch.bfloat16)
    _save(out_dir, net, tokenizer)
    (out_dir / "made.json").write_text(json.dumps(stamp))
    return out_dir


def load_tokenizer(model_path):
    """The tokenizer of a checkpoint directory (its chat template included), offline."""
    from transformers import AutoTokenizer

    path = check_model_dir(model_path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not tokenizer.chat_template:
        raise FileNotFoundError(f"model_path {str(path)!r} has no chat template (none in tokenizer_config.json, no "
                                f"chat_template.jinja): every conversation is rendered through the model's own; copy "
                                f"chat_template.jinja from the chat model of its family (e.g. Qwen2.5-Instruct's)")
    if tokenizer.pad_token is None:  # padding needs one: eos, never trained as padding (labels mask it), not exported
        tokenizer.pad_token = tokenizer.eos_token
        tokenizer.pad_from_eos = True
    return tokenizer


def load_weights(model_path, dtype=None, **kwargs):
    """The model of a checkpoint directory, offline, fp32 master weights by default (transformers v5 would
    load Qwen2.5 in its stored bf16, `dtype="auto"`: training keeps fp32). `kwargs` go to `from_pretrained`."""
    import torch
    from transformers import AutoModelForCausalLM

    path = check_model_dir(model_path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True, **kwargs)
    model.config.use_cache = False
    return model


def load_model(model_path, dtype=None):
    """(model, tokenizer) from a local checkpoint directory: the same two `from_pretrained` calls load a real
    Qwen2.5 (any size) and the course's own checkpoints."""
    return load_weights(model_path, dtype), load_tokenizer(model_path)
