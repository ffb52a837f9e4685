"""Memory theory: how many bytes training needs, before anything runs.

Notation follows the ZeRO paper (Rajbhandari et al., 2020): Ψ parameters, N data-parallel ranks,
K bytes of optimizer state per parameter. Activations follow Korthikanti et al. (2022),
"Reducing Activation Recomputation in Large Transformer Models". Chapter 00 derives these
formulas and checks them against measurements; chapters 01, 03, 06, 07 and 11 reuse them.
"""
from __future__ import annotations

GB = 1e9  # the seeds and the ZeRO paper quote decimal gigabytes
GiB = 2**30

# fp32 optimizer state per parameter, without any master copy of the weights
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd_momentum": 4, "sgd": 0}
# How the weights are held, and the bytes per parameter of (weights, gradients, master copy) each holds; the
# optimizer adds its moments. fp32 throughout; 16-bit mixed precision: 16-bit weights and gradients beside fp32
# master weights (DeepSpeed's bf16, ZeRO's 2 + 2 + 12); autocast over fp32 master weights (the SFT recipe's bf16 on
# one process or DDP), which also keeps a bf16 copy of every matmul weight for backward (`step_memory`'s "copies");
# or "pure" 16-bit weights and gradients with fp32 optimizer moments and no master copy.
STATE_BYTES = {"fp32": (4, 4, 0), "bf16-mixed": (2, 2, 4), "fp16-mixed": (2, 2, 4), "bf16-autocast": (4, 4, 0),
               "bf16-pure": (2, 2, 0)}
PRECISIONS = tuple(STATE_BYTES)
RECOMPUTE = ("none", "selective", "full")


def state_bytes_per_param(precision: str = "bf16-mixed", optimizer: str = "adamw") -> dict:
    """Bytes per parameter for weights, gradients and optimizer state (K, master copy included).

    fp32 + AdamW: 4 + 4 + 8 = 16. bf16 mixed + AdamW: 2 + 2 + (4 master + 8) = 16 as well:
    mixed precision saves activation memory and time, not model-state memory (chapter 01).
    """
    _choose("precision", precision, PRECISIONS)
    _choose("optimizer", optimizer, tuple(OPTIMIZER_STATE_BYTES))
    params, grads, master = STATE_BYTES[precision]
    return {"params": params, "grads": grads, "optimizer": master + OPTIMIZER_STATE_BYTES[optimizer]}


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


def memory_plan(cfg, precision: str = "bf16-mixed", optimizer: str = "adamw", zero_stage: int = 0, ranks: int = 1,
                seq: int = 2048, batch: int = 1, checkpointing: bool = False) -> dict:
    """Per-GPU bytes of one training setup of a Qwen2-shaped model `cfg`: `step_memory` with the calculator's
    knobs (ZeRO stage 0 on several GPUs is DDP). `total` is what is held (the seeds' budgets add these up);
    `peak` is the step's high-water mark, which decides whether it fits; chapter 00's calculator draws both."""
    _check_stage_ranks(zero_stage, ranks)
    backend = f"zero{zero_stage}" if zero_stage else ("ddp" if ranks > 1 else "single")
    plan = step_memory(cfg, backend=backend, ranks=ranks, precision=precision, seq=seq, micro_batch=batch,
                       checkpointing=checkpointing, optimizer=optimizer)
    return {**plan, "activations": plan["activations"] + plan["copies"], "transient": plan["peak"] - plan["total"]}


class MemoryBudgetError(ValueError):
    """A setup the memory model says will not fit; the message is one line that says what to change."""


def check_budget(plan: dict, budget_bytes: float, what: str = "this setup") -> dict:
    """Raise `MemoryBudgetError` when `plan["peak"]` (from `step_memory`) exceeds `budget_bytes`; return `plan`."""
    if plan["peak"] > budget_bytes:
        raise MemoryBudgetError(
            f"{what} needs a predicted peak of {plan['peak'] / GB:.2f} GB per rank ({plan['where']}), over the "
            f"budget of {budget_bytes / GB:.2f} GB: shard more (--fsdp, ZeRO-3, more ranks), checkpoint activations "
            f"(--act-ckpt), shorten --seq-len or --micro-batch, or use --lora")
    return plan


def _choose(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}: choose one of {', '.join(map(str, allowed))}")


def _check_stage_ranks(stage: int, ranks: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a whole number >= 1, got {ranks!r}")


def qwen2_activation_bytes(cfg, seq: int, batch: int, bytes_per_value: int = 4, attention: str = "FLASH_ATTENTION") -> float:
    """Bytes a Qwen2 model saves for backward (no recomputation, SDPA attention): Korthikanti's count
    redone for Qwen2's layer, as chapter 00 derives it from the saved tensors.

    Per token and layer: each RMSNorm keeps its input, the normalized values and the scaled output
    (3h, twice); attention keeps q and its output (2·q_dim), k and v (2·kv_dim, grouped-query heads are
    not repeated) and o_proj's input (h); the SwiGLU MLP keeps gate, SiLU(gate), up and their product
    (4·I). The head keeps a final norm (3h) and the logits (V). Small terms (RoPE tables, 1/rms,
    attention log-sum-exp) are left out; measured on the tiny models it lands within 5% (chapter 00).
    `bytes_per_value=2` counts a 16-bit model: each RMSNorm also keeps its fp32 upcast input (2 bytes more per
    value of it) and the loss its fp32 log-probabilities. `attention`: the SDPA kernel (`cl.models.attention_kernel`);
    a fused one keeps no s x s scores. MATH (CUDA, grouped-query heads in fp32) keeps the probabilities (heads·s
    per token) and k and v repeated to every head (2·(q_dim - kv_dim)): measured on a CPU by forcing it, within 1%.
    """
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    h, inter, vocab, layers = get("hidden_size"), get("intermediate_size"), get("vocab_size"), get("num_hidden_layers")
    heads = get("num_attention_heads")
    head_dim = get("head_dim") or h // heads
    q_dim, kv_dim = heads * head_dim, (get("num_key_value_heads") or heads) * head_dim
    per_layer = 3 * h + 2 * q_dim + 2 * kv_dim + h + 3 * h + 4 * inter
    per_layer += (heads * seq + 2 * (q_dim - kv_dim)) if attention == "MATH" else 0
    upcast = max(0, 4 - bytes_per_value)  # a 16-bit model: fp32 norm inputs, fp32 log-probabilities
    return seq * batch * ((layers * per_layer + 3 * h + vocab) * bytes_per_value
                          + (2 * layers + 1) * h * upcast + vocab * upcast)


# --- one training step, per rank: the course's memory model (chapters 00, 09, 10, 11) ---------------------
BACKENDS = ("single", "ddp", "fsdp2", "zero1", "zero2", "zero3")
ASSUMPTIONS = """\
model states: weights, gradients, optimizer state (AdamW: two fp32 moments, plus the fp32 master copy where the
  weights are 16-bit; DeepSpeed's ZeRO-1/2 keep their own fp32 master copy even in fp32, chapter 06; the SFT
  recipe's ZeRO-3 does not, `cl.zero.share_fp32_master`), sharded by the backend:
  optimizer state by ZeRO-1, + gradients by ZeRO-2, + weights by ZeRO-3 and FSDP2 (whose bf16 is a
  MixedPrecisionPolicy: fp32 shards, bf16 gathered units); LoRA: the frozen base in its own dtype (the SFT recipe's:
  bf16 where it computes in bf16), adapters fp32, the base keeping no inputs for its own gradients (each adapter
  keeps its own: `lora_layer_activation_bytes`).
activations: chapter 00's Qwen2 count (a fused SDPA kernel: no s x s scores), fp32 or bf16; under autocast the
  norms stay fp32 and each linear keeps its own bf16 cast of its input; checkpointing keeps each layer's input and
  recomputes one layer at a time. Not modelled: fp32 grouped-query attention on CUDA without a mask gets the math
  kernel, which keeps the probabilities (`qwen2_activation_bytes(..., attention="MATH")`, chapter 01).
logits: the rows projected onto the vocabulary (all s x b tokens, as Hugging Face does, or the trained positions
  the SFT recipe keeps) as fp32 log-probabilities; the loss holds two such s x V tensors at once, backward three.
the step's temporaries: backward's working set (a layer's activation gradients, ~(3I + h) values a token);
  the optimizer's (fused AdamW: none, also on DeepSpeed's flat partition, as the course's ZeRO configs set it;
  one tensor at a time: the largest local tensor; foreach: every local one);
  FSDP2 keeps the root unit (embedding, final norm) gathered and gathers one layer ahead; ZeRO-3 keeps what
  it gathers until backward reuses it, up to stage3_max_live_parameters (1e8 in the course's configs;
  DeepSpeed's default 1e9 keeps all of a model below 1B parameters gathered), with DeepSpeed's own linear
  (memory_efficient_linear, its default and the configs'; PyTorch's would keep every gathered weight for backward);
  gradient buffers that live between steps: DDP's buckets, ZeRO-3's flat partition.
what training holds, not what an instrument adds: under cl.LiveTensorBytes' dispatch mode autograd sums a tied
  weight's two gradients out of place (ZeRO-3 at 0.5B: one 0.55 GB copy more than an unwatched run holds), counted
  only with `watched=True`, where a prediction stands beside that instrument's figure.
not counted: the framework's own buffers (DDP's and ZeRO's buckets when they are not the gradients, CUDA
  context, allocator cache and fragmentation; gloo's scratch for a CPU collective: about one copy of the full
  tensor for reduce_scatter_tensor and all_gather_into_tensor, none for an in-place all_reduce), which a
  process's RSS or nvidia-smi also show."""


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
    values = 6 * s["h"] + 2 * s["q"] + 2 * s["kv"] + s["h"] + 4 * s["I"]
    if precision == "fp32":
        return 4 * tokens * values
    if precision == "bf16-autocast":  # norms in fp32 (input, normalized), linears' own bf16 inputs, bf16 outputs
        return tokens * (4 * 4 * s["h"] + 2 * 5 * s["h"] + 2 * (2 * s["q"] + 2 * s["kv"] + s["h"] + 4 * s["I"]))
    # 16-bit: each of the two RMSNorms also keeps its fp32 upcast input, 2 bytes more per value (as
    # `qwen2_activation_bytes(..., bytes_per_value=2)`, the count chapter 00 validates)
    return tokens * (2 * values + 2 * 2 * s["h"])


# (d_in, d_out) of each projection of a Qwen2 layer, from `_shape`: what LoRA adapts (peft's all-linear: all seven)
LORA_DIMS = {"q_proj": ("h", "q"), "k_proj": ("h", "kv"), "v_proj": ("h", "kv"), "o_proj": ("q", "h"),
             "gate_proj": ("h", "I"), "up_proj": ("h", "I"), "down_proj": ("I", "h")}


def lora_params(cfg, r: int, targets=tuple(LORA_DIMS)) -> int:
    """Trainable LoRA parameters on `targets` (default: the seven projections) of every layer: r·(d_in + d_out) each."""
    s = _shape(cfg)
    return s["L"] * r * sum(s[LORA_DIMS[t][0]] + s[LORA_DIMS[t][1]] for t in targets)


def lora_layer_activation_bytes(cfg, tokens: int, precision: str = "fp32", r: int = 16, targets=tuple(LORA_DIMS),
                                dropout: float = 0.0, device: str = "cuda") -> float:
    """Bytes one Qwen2 decoder layer keeps for backward when LoRA trains adapters on `targets` of a frozen base.

    The frozen weights need no input kept for their own gradients. peft casts each adapter's input to the adapter's
    dtype (fp32; 16-bit where the precision makes every weight 16-bit), and its A keeps that input: a copy of its own
    where dropout makes one, or autocast casts it to bf16, else the input it shares (q, k and v read one, gate and up
    another, o attention's output, which attention keeps). Dropout keeps its mask: 1 byte a value on a GPU, a tensor of the input's dtype on a CPU (no fused
    kernel there). B keeps A's r outputs. Each frozen RMSNorm keeps its fp32 input (its normalized values only meet
    the frozen scale). Attention keeps q, k, v and its output; the MLP gate, SiLU(gate) and up; in fp32, or in bf16
    under autocast (over a bf16 or an fp32 base) and in the 16-bit precisions."""
    s = _shape(cfg)
    value = 4 if precision == "fp32" else 2
    adapter = 4 if precision in ("fp32", "bf16-autocast") else 2
    mask = (1 if device != "cpu" else adapter) if dropout else 0
    if precision == "bf16-autocast":
        inputs = sum((2 + mask) * s[LORA_DIMS[t][0]] for t in targets)
    elif dropout:
        inputs = sum((adapter + mask) * s[LORA_DIMS[t][0]] for t in targets)
    else:  # one input, kept once, however many adapters read it
        shared = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
        inputs = adapter * sum({shared.get(t, t): s[LORA_DIMS[t][0]] for t in targets if t != "o_proj"}.values())
    per_token = inputs + value * r * len(targets) + 2 * 4 * s["h"] + value * (2 * s["q"] + 2 * s["kv"] + 3 * s["I"])
    return tokens * per_token


def step_memory(cfg, backend: str = "single", ranks: int = 1, precision: str = "fp32", seq: int = 2048,
                micro_batch: int = 1, checkpointing: bool = False, lora_r: int = 0, base_bytes: float | None = None,
                logit_rows: int | None = None, optimizer: str = "adamw", optimizer_kernel: str = "fused",
                zero3_live: float = 1e8, lora_targets=None, lora_dropout: float = 0.0, device: str = "cuda",
                watched: bool = False) -> dict:
    """Per-rank bytes of one training step of a Qwen2-shaped model `cfg` (a config or a dict), by `ASSUMPTIONS`.

    Returns the held parts (`params`, `grads`, `optimizer`, autocast's weight `copies`), what the forward keeps
    (`activations`, `logits`), `total` (their sum: what the seeds' budgets add up), and `peak`: the high-water
    mark of live tensor bytes, the largest of the step's `phases` (forward, loss, backward, step), which a count
    of live tensors (or `torch.cuda.max_memory_allocated`) measures. `lora_r` > 0: LoRA adapters of that rank on
    `lora_targets` (default: the seven projections) with `lora_dropout`, over a frozen base of `base_bytes` a weight
    (default: the precision's weight bytes), its activations `lora_layer_activation_bytes`. `zero3_live`:
    DeepSpeed's stage3_max_live_parameters (and max_reuse_distance): below it, ZeRO-3 keeps what it gathered in
    forward until backward uses it again.
    `device`: "cpu" where the optimizer's kernels work one tensor at a time (chapter 11 measures both shapes there).
    `watched`: the step runs under a dispatch mode that counts live tensors (`cl.LiveTensorBytes`), which changes
    one thing: ZeRO-3's tied weight gets its two gradients summed out of place (one embedding's bytes more at the end
    of backward); training without the instrument adds them in place, and that is what the model predicts by default."""
    _choose("backend", backend, BACKENDS)
    _choose("precision", precision, PRECISIONS)
    _choose("optimizer", optimizer, tuple(OPTIMIZER_STATE_BYTES))
    _choose("optimizer_kernel", optimizer_kernel, ("fused", "tensor", "foreach"))
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a whole number >= 1, got {ranks!r}")
    for name, value in (("seq", seq), ("micro_batch", micro_batch)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    s, psi, n = _shape(cfg), count_params(cfg), ranks
    w, g, master = STATE_BYTES[precision]
    if backend == "fsdp2":
        w, g, master = 4, 4, 0  # fp32 shards step; bf16 (MixedPrecisionPolicy) is only what is gathered
    if backend in ("zero1", "zero2"):
        master = 4  # DeepSpeed's stages 1-2 clone their fp32 partition in fp32 too (chapter 06); the recipe's
        # ZeRO-3 steps the fp32 partition itself (cl.zero.share_fp32_master)
    o = (0 if lora_r else master) + OPTIMIZER_STATE_BYTES[optimizer]  # LoRA's adapters train in fp32: no master copy
    targets = tuple(lora_targets or LORA_DIMS)
    trainable = lora_params(cfg, lora_r, targets) if lora_r else psi
    sharded = {"params": backend in ("fsdp2", "zero3"), "grads": backend in ("fsdp2", "zero2", "zero3"),
               "optimizer": backend in ("fsdp2", "zero1", "zero2", "zero3")}
    per = {k: n if v else 1 for k, v in sharded.items()}
    frozen_bytes = base_bytes if base_bytes is not None else w
    params = ((frozen_bytes * psi + 4 * trainable) if lora_r else w * psi) / per["params"]
    grads = (4 if lora_r else g) * trainable / per["grads"]
    opt_state = o * trainable / per["optimizer"]
    matmul = psi - s["L"] * (2 * s["h"] + s["q"] + 2 * s["kv"]) - s["h"]  # weights without norms and biases
    # autocast's bf16 copy of each fp32 matmul weight: every one; under LoRA the adapters', and the base's if fp32
    fp32_matmul = (trainable + (matmul if frozen_bytes == 4 else 0)) if lora_r else matmul
    copies = 2 * fp32_matmul / per["params"] if precision == "bf16-autocast" else 0
    tokens = seq * micro_batch
    act_dtype = precision if precision in ("fp32", "bf16-autocast") else "bf16"
    value_bytes = 4 if act_dtype == "fp32" else 2
    if lora_r:  # the layers' input (the residual stream) is in the base's dtype; the final norm keeps its fp32 input
        layer = lora_layer_activation_bytes(cfg, tokens, precision, lora_r, targets, lora_dropout, device)
        stream, final_norm = (2 if frozen_bytes == 2 else 4), 4 * s["h"]
    else:  # the final norm keeps its input and normalized values
        layer, stream, final_norm = layer_activation_bytes(cfg, tokens, act_dtype), 4, 2 * s["h"] * 4
    activations = (s["L"] * tokens * s["h"] * stream + layer) if checkpointing else s["L"] * layer
    activations += tokens * final_norm
    logits = (tokens if logit_rows is None else logit_rows) * s["V"] * 4
    working = tokens * (3 * s["I"] + s["h"]) * value_bytes  # backward's activation gradients in one layer
    gathered_bytes = 2 if precision != "fp32" else 4
    layer_params = (psi - s["V"] * s["h"] * (1 if s["tied"] else 2) - s["h"]) // max(1, s["L"])
    root = (s["V"] * s["h"] * (1 if s["tied"] else 2) + s["h"]) * gathered_bytes
    gathered = {"fsdp2": root + 2 * layer_params * gathered_bytes,  # the root, one layer and the next
                "zero3": min(psi, zero3_live) * gathered_bytes}.get(backend, 0)
    embedding = s["V"] * s["h"] * 4  # the largest tensor: the (tied) embedding, and its gradient
    # the largest tensor the optimizer steps: the embedding, or LoRA's largest adapter (r x the widest side)
    adapter = 4 * lora_r * max(max(s[d] for d in LORA_DIMS[t]) for t in targets)
    largest = (adapter if lora_r else embedding) / per["optimizer"]
    if optimizer_kernel == "foreach" and device != "cpu":
        opt_tmp = 4 * trainable / per["optimizer"]  # one temporary list as large as every local tensor
    else:  # one tensor at a time (CPU's fused and for-loop kernels): two temporaries of the largest
        opt_tmp = 0 if device != "cpu" else 2 * largest
    if backend.startswith("zero"):  # torch's AdamW on DeepSpeed's flat fp32 partition: the fused kernel works in
        # place (the course's configs); the others make temporaries as large as the partition (and its gradient)
        opt_tmp = 0 if optimizer_kernel == "fused" else (3 if device == "cpu" else 1) * 4 * trainable / per["optimizer"]
    kept_grads = grads if backend in ("ddp", "zero3") else 0  # DDP's buckets, ZeRO-3's flat partition: between steps
    held = params + opt_state + kept_grads + copies + gathered
    # backward's end: every gradient, and the embedding's and the head's weight gradients in flight (one, stolen
    # into .grad; three where gradients are copied into buckets or reduce-scatter inputs: DDP, FSDP2, ZeRO-1/2; ZeRO-3:
    # the tied weight's gradient from the head and the one from the embedding, and, only while a dispatch mode
    # watches (`watched`), their sum, which autograd then makes out of place; without one it adds in place)
    flights = 1 if backend == "single" else 2 + watched if backend == "zero3" else 3
    in_flight = embedding * flights * (1 if lora_r == 0 else 0)
    phases = {"forward": held + activations + logits,
              "loss": held + activations + 2 * logits,
              "backward": max(held + activations + max(3 * logits, logits + working),
                              params + opt_state + copies + gathered + grads + in_flight),
              # ZeRO-1/2 step their flat fp32 partition, whose gradient is the one made for the step (for-loop
              # AdamW: one of its temporaries); ZeRO-3's gradient partition stays beside them (0.5B: 0.99 GB a rank)
              "step": params + opt_state + opt_tmp + (0 if backend in ("zero1", "zero2") else grads)}
    peak = max(phases.values())
    return {"params": params, "grads": grads, "optimizer": opt_state, "copies": copies, "activations": activations,
            "logits": logits, "total": params + grads + opt_state + copies + activations + logits, "peak": peak,
            "phases": phases, "where": max(phases, key=phases.get), "num_params": psi, "trainable": trainable}
