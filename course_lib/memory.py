"""Memory theory: how many bytes training needs, before anything runs.

Notation follows the ZeRO paper (Rajbhandari et al., 2020): Ψ parameters, N data-parallel ranks,
K bytes of optimizer state per parameter. Activations follow Korthikanti et al. (2022),
"Reducing Activation Recomputation in Large Transformer Models". Chapter 00 derives these
formulas and checks them against measurements; chapters 01, 03, 06, 07 and 11 reuse them.
"""
from __future__ import annotations

GB = 1e9  # the seeds and the ZeRO paper quote decimal gigabytes
GiB = 2**30

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# fp32 optimizer state per parameter, without any master copy of the weights
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd_momentum": 4, "sgd": 0}
# how the weights are held: fp32 throughout; 16-bit mixed precision with an fp32 master copy;
# or "pure" 16-bit weights and gradients with fp32 optimizer moments and no master copy
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-pure")
RECOMPUTE = ("none", "selective", "full")


def state_bytes_per_param(precision: str = "bf16-mixed", optimizer: str = "adamw") -> dict:
    """Bytes per parameter for weights, gradients and optimizer state (K, master copy included).

    fp32 + AdamW: 4 + 4 + 8 = 16. bf16 mixed + AdamW: 2 + 2 + (4 master + 8) = 16 as well:
    mixed precision saves activation memory and time, not model-state memory (chapter 01).
    """
    _choose("precision", precision, PRECISIONS)
    _choose("optimizer", optimizer, tuple(OPTIMIZER_STATE_BYTES))
    moments = OPTIMIZER_STATE_BYTES[optimizer]
    if precision == "fp32":
        return {"params": 4, "grads": 4, "optimizer": moments}
    if precision == "bf16-pure":
        return {"params": 2, "grads": 2, "optimizer": moments}
    return {"params": 2, "grads": 2, "optimizer": 4 + moments}


def zero_state_bytes(num_params: float, stage: int, ranks: int, params: float = 2, grads: float = 2, k: float = 12) -> dict:
    """Per-rank model-state bytes under ZeRO stage 0-3 (ZeRO paper, Figure 1).

    stage 0: (2 + 2 + K)Ψ    stage 1: 2Ψ + 2Ψ + KΨ/N    stage 2: 2Ψ + (2 + K)Ψ/N    stage 3: (2 + 2 + K)Ψ/N
    (with 16-bit weights and gradients; pass params=4, grads=4 for fp32).
    """
    _check_stage_ranks(stage, ranks)
    shard = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
    per = {"params": params, "grads": grads, "optimizer": k}
    out = {part: num_params * per[part] / (ranks if shard[part] else 1) for part in per}
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, recompute: str = "none") -> float:
    """Bytes a transformer layer keeps for backward, 16-bit activations (Korthikanti et al., eq. 1-2).

    none: s·b·h·(34 + 5·a·s/h)   selective (attention scores recomputed, or FlashAttention): 34·s·b·h
    full (only the layer's input kept, the rest recomputed in backward): 2·s·b·h
    """
    _choose("recompute", recompute, RECOMPUTE)
    sbh = seq * batch * hidden
    if recompute == "full":
        return 2 * sbh
    if recompute == "selective":
        return 34 * sbh
    return sbh * (34 + 5 * heads * seq / hidden)


def count_params(cfg) -> int:
    """Parameters of a Qwen2-style decoder from its config (a dict or a transformers config).

    Embedding V·h; per layer: q/k/v projections with bias (grouped-query k/v), o without bias,
    SwiGLU MLP 3·h·I, two RMSNorms; a final norm; an untied output head V·h unless tied.
    """
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    h, inter, vocab, layers = get("hidden_size"), get("intermediate_size"), get("vocab_size"), get("num_hidden_layers")
    heads = get("num_attention_heads")
    kv = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or h // heads
    q, kv_out = heads * head_dim, kv * head_dim
    attn = (h * q + q) + 2 * (h * kv_out + kv_out) + q * h
    layer = attn + 3 * h * inter + 2 * h
    head = 0 if get("tie_word_embeddings", False) else vocab * h
    return vocab * h + layers * layer + h + head


def memory_plan(num_params: float, layers: int, hidden: int, heads: int, precision: str = "bf16-mixed",
                optimizer: str = "adamw", zero_stage: int = 0, ranks: int = 1, seq: int = 2048, batch: int = 1,
                checkpointing: bool = False) -> dict:
    """Per-GPU bytes for one training setup: the sum the chapter 00 calculator draws as a stacked bar.

    Activations use Korthikanti's formula with selective recomputation (what FlashAttention/SDPA
    gives for free), or full recomputation when `checkpointing`; in fp32 they take twice the bytes.
    """
    _check_stage_ranks(zero_stage, ranks)
    for name, value in (("num_params", num_params), ("layers", layers), ("seq", seq), ("batch", batch)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    per = state_bytes_per_param(precision, optimizer)
    plan = zero_state_bytes(num_params, zero_stage, ranks, per["params"], per["grads"], per["optimizer"])
    act = activation_bytes_per_layer(seq, batch, hidden, heads, "full" if checkpointing else "selective")
    plan["activations"] = layers * act * (2 if precision == "fp32" else 1)
    plan["total"] = plan["params"] + plan["grads"] + plan["optimizer"] + plan["activations"]
    return plan


def _choose(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}: choose one of {', '.join(map(str, allowed))}")


def _check_stage_ranks(stage: int, ranks: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a whole number >= 1, got {ranks!r}")


def qwen2_activation_bytes(cfg, seq: int, batch: int, bytes_per_value: int = 4) -> float:
    """Bytes a Qwen2 model saves for backward (no recomputation, SDPA attention): Korthikanti's count
    redone for Qwen2's layer, as chapter 00 derives it from the saved tensors.

    Per token and layer: each RMSNorm keeps its input, the normalized values and the scaled output
    (3h, twice); attention keeps q and its output (2·q_dim), k and v (2·kv_dim, grouped-query heads are
    not repeated) and o_proj's input (h); the SwiGLU MLP keeps gate, SiLU(gate), up and their product
    (4·I). The head keeps a final norm (3h) and the logits (V). Small terms (RoPE tables, 1/rms,
    attention log-sum-exp) are left out; measured on the tiny models it lands within 5% (chapter 00).
    """
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    h, inter, vocab, layers = get("hidden_size"), get("intermediate_size"), get("vocab_size"), get("num_hidden_layers")
    heads = get("num_attention_heads")
    head_dim = get("head_dim") or h // heads
    q_dim, kv_dim = heads * head_dim, (get("num_key_value_heads") or heads) * head_dim
    per_layer = 3 * h + 2 * q_dim + 2 * kv_dim + h + 3 * h + 4 * inter
    return seq * batch * (layers * per_layer + 3 * h + vocab) * bytes_per_value
