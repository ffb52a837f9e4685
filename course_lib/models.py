"""Models: the Qwen2.5 family's shapes, and tiny random-init Qwen2 models built from a config.

No weights are downloaded: the CPU profile builds `Qwen2ForCausalLM` from a small `Qwen2Config`;
the real Qwen2.5 configs below (from the models' config.json files) feed the memory calculator.
Introduced in chapter 00; every PyTorch chapter builds its model here.
"""
from __future__ import annotations

import torch

# The CPU profile's tiny Qwen2 (≈ 0.9M parameters with a 1,024-word vocabulary): the one place its shape is written.
TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=512, vocab_size=1024, tie_word_embeddings=True)
# Every projection of a Qwen2 decoder layer: where LoRA puts its adapters (chapter 09, the SFT recipe's --lora)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
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


def qwen2_config(max_position_embeddings: int = 2048, **size):
    """A `Qwen2Config` of the given size; what is not given comes from `TINY`."""
    from transformers import Qwen2Config

    return Qwen2Config(**{**TINY, **size}, max_position_embeddings=max_position_embeddings, use_cache=False)


KEEP_LAST_BUILT = False  # the gpu profile turns it on (presets.setup): a chapter there builds its 0.5B model many times
_LAST_BUILT: dict = {}  # the last model built, {key: (model, RNG states after its build)}: one copy, no more
# Where random init draws its numbers. The gpu profile's setup sets "cuda": at 0.5B, init on a CPU takes ~13 s whatever
# the thread count (measured on 1 and 2 threads: the random number generator is serial), on a GPU well under a second.
# The model comes back on the CPU either way; its weights differ from a CPU build's (another generator), so only
# the kernel that set it builds there (launched ranks keep "cpu").
INIT_DEVICE = "cpu"


def _rng_states() -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if INIT_DEVICE == "cuda" else None)


def _set_rng_states(states: tuple) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])


def _random_init(config, seed: int):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    if INIT_DEVICE == "cpu":
        return Qwen2ForCausalLM(config)
    with torch.device(INIT_DEVICE):  # every tensor made inside is made there
        model = Qwen2ForCausalLM(config)
    return model.to("cpu")


def tiny_qwen2(config=None, seed: int = 0, dtype: torch.dtype = torch.float32, **size):
    """A random-init `Qwen2ForCausalLM` (fp32 unless asked, on the CPU), seeded so every run builds the same one.

    With `KEEP_LAST_BUILT` (the gpu profile: random init of a 0.5B model takes ~13 s on a CPU, a copy ~1.5 s) the
    last one built is kept, and asking again for it returns a deep copy, with the RNG left as a fresh build leaves
    it: the same weights, the same random numbers after, either way (tests/test_course_lib.py). Off by default:
    the kept copy costs its size in host memory (2 GB at 0.5B), which a CPU rank beside others cannot spare.
    `INIT_DEVICE`: where the random numbers are drawn (the gpu profile: its GPU)."""
    import copy

    config = config or qwen2_config(**size)
    if not KEEP_LAST_BUILT:
        return _random_init(config, seed).to(dtype)
    key = (config.to_json_string(), seed, INIT_DEVICE)
    if key not in _LAST_BUILT:
        model = _random_init(config, seed)
        _LAST_BUILT.clear()
        _LAST_BUILT[key] = (model, _rng_states())
    model, rng = _LAST_BUILT[key]
    _set_rng_states(rng)
    return copy.deepcopy(model).to(dtype)


def random_batch(vocab_size: int, batch: int, seq: int, seed: int = 0, device: torch.device | str = "cpu") -> dict:
    """Random token ids as a causal-LM batch (labels = input ids; the model shifts them itself)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}


def add_lora(model, r: int, alpha: float, dropout: float = 0.0, targets=LORA_TARGETS):
    """LoRA (chapter 09) with peft on `targets`: the base weights frozen, adapters A, B trained."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                                            task_type="CAUSAL_LM"))


def checkpoint_layers(model, on: bool = True, every_n_layers: int = 1, **checkpoint_kwargs) -> None:
    """Recompute every `every_n_layers`-th decoder layer of a Hugging Face model in backward (chapter 03), or,
    with on=False, stop. `checkpoint_kwargs` go to `torch.utils.checkpoint.checkpoint` (use_reentrant=False
    unless given). transformers 5.23 renamed the switch: `activation_checkpointing_enable(
    activation_checkpointing_kwargs=...)` from 5.23 (the old name then warns that it is deprecated),
    `gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)` up to 5.22; both take `every_n_layers`
    in every version the course supports (5.17 on)."""
    kwargs = {"use_reentrant": False, **checkpoint_kwargs}
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
    else:
        model.gradient_checkpointing_disable()


def attention_kernel(config, device, dtype: torch.dtype) -> str:
    """The kernel `scaled_dot_product_attention` runs for this model's causal self-attention without a padding mask
    (how the chapters call it), asked of PyTorch itself: FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION or
    MATH. It decides what attention saves for backward (`cl.memory.qwen2_activation_bytes(..., attention=...)`).
    Grouped-query heads pass to SDPA as they are (`enable_gqa`) where transformers does so (on CUDA: no mask), and
    on CUDA only flash (16-bit) and math take them: in fp32 there, math, which stores the probabilities.
    On a CPU, flash in every dtype."""
    from torch.nn.attention import SDPBackend
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    q = torch.empty(1, heads, 16, head_dim, device=device, dtype=dtype)
    kv = torch.empty(1, kv_heads, 16, head_dim, device=device, dtype=dtype)
    gqa = kv_heads != heads and use_gqa_in_sdpa(None, kv, kv)
    if not gqa:
        kv = kv.repeat_interleave(heads // kv_heads, dim=1)  # transformers' repeat_kv: every head its own k and v
    return SDPBackend(torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=gqa)).name
