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


# --- one training step, per rank: the course's memory model (chapters 00, 09, 10, 11) ---------------------
BACKENDS = ("single", "ddp", "fsdp2", "zero1", "zero2", "zero3")
# Assumptions, in one place:
# * bytes per parameter (weights, gradients, optimizer state) by precision recipe; AdamW's two fp32 moments.
#   "bf16-autocast" is PyTorch autocast over fp32 master weights (the SFT recipe's bf16 on one process/DDP),
#   which also keeps a bf16 copy of every matmul weight for backward ("copies"); DeepSpeed holds separate fp32
#   master weights even in fp32 mode (chapter 06: K = 12); FSDP2's bf16 is MixedPrecisionPolicy: fp32 shards,
#   bf16 gathered units.
# * activations: the Qwen2 count validated in chapter 00 (SDPA attention: no s² scores), in the activation
#   dtype; under autocast the norms stay fp32 and each linear keeps its own bf16 cast of its input.
#   Checkpointing keeps each layer's input, and recomputes one layer at a time in backward.
# * logits: the rows projected onto the vocabulary (`logit_rows`: all s·b tokens as Hugging Face does, or the
#   SFT recipe's trained positions only), kept as fp32 log-probabilities; the loss's peak is twice that in
#   forward (logits + log-probabilities) and three times in backward (with both gradients).
# * the step's temporaries: the optimizer's (fused AdamW: none; one tensor at a time: the largest local
#   tensor; foreach: all local trainable bytes), FSDP2's gathered units (the root stays gathered, one layer
#   plus one prefetched), ZeRO-3's gathered parameters and prefetch bucket, ZeRO's reduce buckets.
STATE_BYTES = {"fp32": (4, 4, 8), "bf16-autocast": (4, 4, 8), "bf16-mixed": (2, 2, 12), "bf16-pure": (2, 2, 8)}


def _shape(cfg) -> dict:
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    heads = get("num_attention_heads")
    head_dim = get("head_dim") or get("hidden_size") // heads
    return {"h": get("hidden_size"), "I": get("intermediate_size"), "V": get("vocab_size"), "L": get("num_hidden_layers"),
            "q": heads * head_dim, "kv": (get("num_key_value_heads") or heads) * head_dim,
            "tied": bool(get("tie_word_embeddings", False))}


def layer_activation_bytes(cfg, tokens: int, precision: str = "fp32") -> float:
    """Bytes one Qwen2 decoder layer keeps for backward for `tokens` tokens (chapter 00's count)."""
    s = _shape(cfg)
    values_fp32 = 6 * s["h"] + 2 * s["q"] + 2 * s["kv"] + s["h"] + 4 * s["I"]
    if precision == "fp32":
        return 4 * tokens * values_fp32
    if precision == "bf16-autocast":  # norms in fp32 (input, normalized), linears' bf16 inputs, bf16 outputs
        return tokens * (4 * 4 * s["h"] + 2 * 5 * s["h"] + 2 * (2 * s["q"] + 2 * s["kv"] + s["h"] + 4 * s["I"]))
    return 2 * tokens * values_fp32


def lora_params(cfg, r: int) -> int:
    """Trainable LoRA parameters on the seven projections of every layer: r·(d_in + d_out) each."""
    s = _shape(cfg)
    h, q, kv, inter = s["h"], s["q"], s["kv"], s["I"]
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + inter) + (inter + h)
    return s["L"] * r * per_layer


def step_memory(cfg, backend: str = "single", ranks: int = 1, precision: str = "fp32", seq: int = 2048,
                micro_batch: int = 1, checkpointing: bool = False, lora_r: int = 0, base_bytes: float | None = None,
                logit_rows: int | None = None, optimizer_kernel: str = "fused") -> dict:
    """Per-rank bytes of one training step of a Qwen2-shaped model `cfg` (a config or a dict).

    Returns the held parts (`params`, `grads`, `optimizer`, autocast's weight `copies`), what the forward keeps
    (`activations`, `logits`), `total` (their sum: what the seeds' budgets add up) and `peak`: the high-water
    mark of live tensor bytes during the step, the largest of its phases (`phases`: forward, loss, backward,
    step), which a measurement of live bytes (or `torch.cuda.max_memory_allocated`) sees. See the assumptions
    above. `base_bytes`: bytes of a frozen LoRA base weight (default: the precision's weight bytes)."""
    _choose("backend", backend, BACKENDS)
    _choose("precision", precision, tuple(STATE_BYTES))
    _choose("optimizer_kernel", optimizer_kernel, ("fused", "tensor", "foreach"))
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a whole number >= 1, got {ranks!r}")
    if ranks == 1 and backend in ("ddp", "fsdp2", "zero1", "zero2", "zero3"):
        ranks = 1  # (one rank: the sharded backends hold everything, as DeepSpeed and FSDP2 do alone)
    for name, value in (("seq", seq), ("micro_batch", micro_batch)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    s, psi = _shape(cfg), count_params(cfg)
    w, g, o = STATE_BYTES[precision]
    if backend.startswith("zero"):
        o = 12 if precision == "fp32" else o  # DeepSpeed's separate fp32 master copy (chapter 06)
    trainable = lora_params(cfg, lora_r) if lora_r else psi
    frozen = psi if lora_r else 0
    n = ranks
    shard_w = backend in ("fsdp2", "zero3")
    shard_g = backend in ("fsdp2", "zero2", "zero3")
    shard_o = backend in ("fsdp2", "zero1", "zero2", "zero3")
    lora_w = 4 if lora_r else w
    params = ((base_bytes if base_bytes is not None else w) * frozen + lora_w * (trainable if lora_r else psi))
    params /= n if shard_w else 1
    grads = g * trainable / (n if shard_g else 1)
    optimizer = o * trainable / (n if shard_o else 1)
    matmul = psi - s["L"] * (2 * s["h"] + s["q"] + 2 * s["kv"]) - s["h"]  # weights without norms and biases
    copies = 2 * matmul / (n if shard_w else 1) if precision == "bf16-autocast" else 0
    tokens = seq * micro_batch
    act_precision = precision if precision in ("fp32", "bf16-autocast") else "bf16"
    layer = layer_activation_bytes(cfg, tokens, act_precision)
    if checkpointing:
        activations = s["L"] * tokens * s["h"] * 4 + layer  # layer inputs; one layer recomputed at a time
    else:
        activations = s["L"] * layer
    activations += tokens * 2 * s["h"] * 4  # the final norm's input and normalized values
    rows = tokens if logit_rows is None else logit_rows
    logits = rows * s["V"] * 4
    # temporaries of the step's phases
    unit = 4 if precision in ("fp32", "bf16-autocast") else 2
    layer_params = psi - s["V"] * s["h"] * (1 if s["tied"] else 2) - s["h"]
    layer_params //= max(1, s["L"])
    gathered = 0
    if backend == "fsdp2":  # the root (embedding, final norm) stays gathered; one layer and the next one prefetched
        gathered = (s["V"] * s["h"] + s["h"]) * (2 if precision != "fp32" else 4) * (1 - 1 / n) \
            + 2 * layer_params * (2 if precision != "fp32" else 4)
    elif backend == "zero3":
        gathered = 2 * layer_params * unit + s["V"] * s["h"] * unit * (1 - 1 / n)
    largest = s["V"] * s["h"] * 4 / (n if shard_o else 1)
    opt_tmp = {"fused": 0, "tensor": largest, "foreach": 4 * trainable / (n if shard_o else 1)}[optimizer_kernel]
    if backend in ("zero1", "zero2", "zero3"):
        opt_tmp = 4 * trainable / n  # torch AdamW on DeepSpeed's flat fp32 partition: one tensor that size
    held = params + optimizer + (grads if backend in ("ddp", "zero1", "zero2") else 0)  # between steps
    phases = {
        "forward": held + copies + activations + gathered + logits,
        "loss": held + copies + activations + gathered + 2 * logits,
        "backward": held + copies + activations + gathered + 3 * logits + (grads if backend not in
                                                                          ("ddp", "zero1", "zero2") else 0) * 0,
        "step": params + grads + optimizer + opt_tmp,
    }
    phases["backward"] = max(phases["backward"], held + copies + gathered + grads + logits)
    peak = max(phases.values())
    total = params + grads + optimizer + copies + activations + logits
    return {"params": params, "grads": grads, "optimizer": optimizer, "copies": copies, "activations": activations,
            "logits": logits, "total": total, "peak": peak, "phases": phases,
            "where": max(phases, key=phases.get), "num_params": psi, "trainable": trainable}
