"""Models: the Qwen2.5 family's shapes, and tiny random-init Qwen2 models built from a config.

No weights are downloaded: the CPU profile builds `Qwen2ForCausalLM` from a small `Qwen2Config`;
the real Qwen2.5 configs below (from the models' config.json files) feed the memory calculator.
Introduced in chapter 00; every PyTorch chapter builds its model here.
"""
from __future__ import annotations

import torch

# Shapes of the released Qwen2.5 models (config.json on the Hub), for planning memory.
QWEN25 = {
    "Qwen2.5-0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Qwen2.5-14B": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "Qwen2.5-32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}


def qwen2_config(hidden_size: int = 128, num_hidden_layers: int = 4, num_attention_heads: int = 4,
                 num_key_value_heads: int = 2, intermediate_size: int = 512, vocab_size: int = 1024,
                 max_position_embeddings: int = 2048, tie_word_embeddings: bool = True, **extra):
    """A `Qwen2Config` of the given size (defaults: ≈ 0.9M parameters, four layers)."""
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                       num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                       intermediate_size=intermediate_size, vocab_size=vocab_size,
                       max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                       use_cache=False, **extra)


def tiny_qwen2(config=None, seed: int = 0, dtype: torch.dtype = torch.float32, **size):
    """A random-init `Qwen2ForCausalLM` (fp32 unless asked), seeded so every run builds the same one."""
    from transformers import Qwen2ForCausalLM

    config = config or qwen2_config(**size)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).to(dtype)


def random_batch(vocab_size: int, batch: int, seq: int, seed: int = 0, device: torch.device | str = "cpu") -> dict:
    """Random token ids as a causal-LM batch (labels = input ids; the model shifts them itself)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}


SIZE_FLAGS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size")


def add_size_args(parser, **defaults) -> None:
    """Add `--hidden-size`, `--num-hidden-layers`, ... to a recipe's parser (defaults: the CPU profile's
    tiny model, or `defaults`); `size_from_args(args)` turns them back into `qwen2_config` keywords."""
    from .presets import TINY

    for name in SIZE_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=defaults.get(name, TINY[name]))


def size_from_args(args) -> dict:
    return {name: getattr(args, name) for name in SIZE_FLAGS}
