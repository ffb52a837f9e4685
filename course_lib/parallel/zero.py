"""ZeRO with DeepSpeed: the config files, checking them before any rank starts, and what a rank holds.

- `load_config(name)`: a JSON file from course_lib/parallel/configs/ (zero0 ... zero3_offload), or any path;
  `stage(name)`, its ZeRO stage.
- `resolve_auto(config, ...)`: fill the HF-Trainer-style `"auto"` values the way the Trainer does.
- `validate(config, world_size)`: one-line `ZeroConfigError`s for mistakes DeepSpeed would report late
  (after every rank has started) or not at all.
- `held_bytes(engine)` and `GradPeak`: walk a DeepSpeed engine's optimizer and count, per rank, the bytes
  of parameters, gradients and optimizer state it holds, ZeRO-3's partitioned parameters included,
  and which tier (accelerator or host) each sits in.
- `initialize(model, config, ...)`: the engine, the one way the course starts DeepSpeed (`no_jit()` first: no C++
  op compiled at run time).
Chapter 06 explains all of it; course_lib/recipes/zero.py uses it on every rank.
"""
from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from pathlib import Path

import torch

from ..memory.measure import flat_tensors as _flat
from ..memory.measure import gradient_tensors, optimizer_state_tensors, tensor_bytes

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
CONFIGS = ("zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload")


class ZeroConfigError(ValueError):
    """A DeepSpeed config that cannot work; the message is one line that says what to change."""


def config_path(name: str) -> Path:
    """course_lib/parallel/configs/<name>.json for a shipped config name, else `name` as a path."""
    path = CONFIG_DIR / f"{name}.json"
    if path.is_file():
        return path
    path = Path(name)
    if not path.is_file():
        raise ZeroConfigError(f"no DeepSpeed config {name!r}: use one of {', '.join(CONFIGS)} or a path to a .json file")
    return path


def load_config(name: str) -> dict:
    """A shipped config by name (`"zero2"`) or a JSON file by path, as a dict."""
    path = config_path(name)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ZeroConfigError(f"{path.name} is not valid JSON: {e}") from None


def stage(name: str) -> int:
    """The ZeRO stage of a shipped config by name or a JSON file by path (0 where it names none)."""
    return load_config(name).get("zero_optimization", {}).get("stage", 0)


def resolve_auto(config: dict, *, world_size: int, micro_batch: int, accum_steps: int, hidden_size: int,
                 lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8,
                 max_grad_norm: float = 1.0, precision: str = "bf16", persistence_threshold: int | None = None) -> dict:
    """A copy of `config` with every `"auto"` replaced the way HF Trainer does it.

    Batch sizes come from the run (train_batch_size = micro × accumulation × ranks), the optimizer's
    hyper-parameters from the arguments, fp16/bf16 `enabled` from `precision`, and three ZeRO sizes
    from the model's hidden size h: reduce_bucket_size = h², stage3_prefetch_bucket_size = 0.9·h²,
    stage3_param_persistence_threshold = 10·h (or `persistence_threshold` when given: 0 partitions
    every parameter, which a tiny model needs to show ZeRO-3 at all). A value the config sets itself
    must agree with the run's (HF Trainer checks the same): otherwise one `ZeroConfigError` lists each
    mismatch, instead of the config silently overriding the command line.
    """
    cfg = copy.deepcopy(config)
    values = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accum_steps,
        "train_batch_size": micro_batch * accum_steps * world_size,
        "gradient_clipping": max_grad_norm,
    }
    mismatches = []
    for key, value in values.items():
        if cfg.get(key) == "auto":
            cfg[key] = value
        elif key in cfg and cfg[key] != value:
            mismatches.append(f"{key}={cfg[key]} (the run: {value})")
    params = cfg.get("optimizer", {}).get("params", {})
    for key, value in {"lr": lr, "weight_decay": weight_decay, "betas": list(betas), "eps": eps}.items():
        if params.get(key) == "auto":
            params[key] = value
        elif key in params and params[key] != value:
            mismatches.append(f"optimizer.params.{key}={params[key]} (the run: {value})")
    if mismatches:
        raise ZeroConfigError(f"the DeepSpeed config disagrees with the run: {'; '.join(mismatches)}: set these to "
                              f"\"auto\" (filled from the run) or pass the same values")
    for name in ("fp16", "bf16"):
        if cfg.get(name, {}).get("enabled") == "auto":
            cfg[name]["enabled"] = precision == name
    zero = cfg.get("zero_optimization", {})
    sizes = {"reduce_bucket_size": hidden_size * hidden_size,
             "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
             "stage3_param_persistence_threshold": 10 * hidden_size}
    for key, value in sizes.items():
        if zero.get(key) == "auto":
            zero[key] = value
    if persistence_threshold is not None and "stage3_param_persistence_threshold" in zero:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
        zero["model_persistence_threshold"] = persistence_threshold
    return cfg


def _autos(obj, where: str = "") -> list[str]:
    if isinstance(obj, dict):
        return [w for k, v in obj.items() for w in _autos(v, f"{where}.{k}" if where else k)]
    return [where] if obj == "auto" else []


def validate(config: dict, world_size: int) -> dict:
    """Check `config` for `world_size` ranks; raise `ZeroConfigError` (one line) or return it unchanged."""
    left = _autos(config)
    if left:
        raise ZeroConfigError(f"unresolved \"auto\" in {', '.join(left)}: call resolve_auto() (HF Trainer does it for you)")
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ZeroConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    micro = config.get("train_micro_batch_size_per_gpu")
    accum = config.get("gradient_accumulation_steps", 1)
    total = config.get("train_batch_size")
    if micro is None or total is None:
        raise ZeroConfigError("set train_batch_size and train_micro_batch_size_per_gpu (or \"auto\")")
    if total != micro * accum * world_size:
        raise ZeroConfigError(f"train_batch_size {total} != micro-batch {micro} × accumulation {accum} × ranks "
                              f"{world_size} = {micro * accum * world_size}")
    if zero.get("offload_param", {}).get("device", "none") != "none" and stage < 3:
        raise ZeroConfigError(f"offload_param needs stage 3 (parameters are partitioned only there), got stage {stage}")
    if zero.get("offload_optimizer", {}).get("device", "none") != "none" and stage < 1:
        raise ZeroConfigError("offload_optimizer needs stage 1, 2 or 3, got stage 0")
    fp16, bf16 = config.get("fp16", {}).get("enabled", False), config.get("bf16", {}).get("enabled", False)
    if fp16 and bf16:
        raise ZeroConfigError("fp16 and bf16 are both enabled: choose one")
    if fp16 and not torch.cuda.is_available():
        raise ZeroConfigError("fp16 needs a GPU in this course (DeepSpeed accepts fp16 on a CPU only where oneDNN "
                              "has fp16): use bf16")
    params = config.get("optimizer", {}).get("params", {})
    if config.get("optimizer") and not params.get("torch_adam") and not torch.cuda.is_available():
        raise ZeroConfigError("set optimizer.params.torch_adam=true on CPU, or DeepSpeed compiles its Adam (minutes)")
    return config


def prepare(name: str, world_size: int, **run) -> dict:
    """`load_config` + `resolve_auto(**run)` + `validate`: what the notebook and the recipe both call."""
    return validate(resolve_auto(load_config(name), world_size=world_size, **run), world_size)


def no_jit() -> None:
    """Tell DeepSpeed not to build its shared-memory communication op (a ~3 min C++ compile on CPU).

    The other ops it would build on first use (fused_adam, cpu_adam) are avoided by the configs'
    `"torch_adam": true`. Call before `deepspeed.initialize`. DeepSpeed has no public switch for it: this marks the
    op unavailable in its own table of compatible ops (a patch of its internals, the one way there is).
    """
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def initialize(model, config: dict, params=None, lr_scheduler=None, share_master: bool = False) -> tuple:
    """A DeepSpeed engine around `model`: the one way the course starts DeepSpeed (chapter 06's recipe, the SFT
    recipe's DeepSpeed backend). No C++ op built at run time (`no_jit`); `config` as `prepare` made it; `params`:
    what the optimizer steps (default: the model's parameters; the SFT recipe passes AdamW's decay groups);
    `lr_scheduler`: a function of the optimizer, which the engine steps. `share_master`: ZeRO-3 in fp32 steps its
    partition itself (`share_fp32_master`, 4Ψ/N less); chapter 06 measures DeepSpeed as it ships (False).
    Returns (engine, optimizer, scheduler)."""
    import deepspeed

    no_jit()
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters() if params is None else params, config=config,
        lr_scheduler=lr_scheduler)
    if share_master:
        share_fp32_master(engine)
    return engine, optimizer, scheduler


@contextmanager
def without_random_init():
    """Build a model under ZeRO-3 without transformers' random initialization: `from_config` fills a model built under
    `zero.Init` by gathering each module's shards in turn (`initialize_weights_zero3`), work `fill_from_rank0`
    overwrites next (at the 0.5B shape on 2 CPU ranks, 16 of the 44 s before the first step). Where a transformers
    release lacks that function, nothing changes. A patch for the block (transformers has no public switch)."""
    from unittest import mock

    from transformers.integrations import deepspeed as hf_deepspeed

    if not hasattr(hf_deepspeed, "initialize_weights_zero3"):
        yield
        return
    with mock.patch.object(hf_deepspeed, "initialize_weights_zero3", lambda model: None):
        yield


def fill_from_rank0(model, path) -> None:
    """Load a checkpoint directory's weights into a model ZeRO-3 partitioned at construction: one parameter at a
    time, every rank gathers it, rank 0 (`path`; None on the others) copies the stored tensor in, and DeepSpeed
    partitions it again. The checkpoint is read lazily (safetensors), so no rank ever holds the whole model."""
    import deepspeed
    from safetensors import safe_open

    files = [safe_open(str(f), "pt") for f in sorted(Path(path).glob("*.safetensors"))] if path is not None else []
    where = {key: f for f in files for key in f.keys()}
    for name, param in model.named_parameters():  # a tied head shares the embedding: listed once
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if path is not None:
                if name not in where:
                    raise FileNotFoundError(f"{path}: the checkpoint has no tensor {name!r}")
                param.data.copy_(where[name].get_tensor(name))


def gathered_state_dict(model, dtype, is_main: bool) -> dict:
    """A ZeRO-3 model's full weights on rank 0's CPU in `dtype`, gathered one parameter at a time (collective;
    the other ranks get `{}`). Buffers come as they are: ZeRO-3 does not partition them."""
    import deepspeed

    state = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            if is_main:
                state[name] = param.data.detach().to("cpu", dtype, copy=True)
    if is_main:
        state.update({name: b.detach().cpu() for name, b in model.named_buffers() if name in model.state_dict()})
    return state


# ---------------------------------------------------------------- what one rank holds

@contextmanager
def gathered(engine, value=None):
    """A ZeRO-3 engine's parameters gathered once for what runs inside (generation), ZeRO's per-layer hooks lifted
    meanwhile: DeepSpeed's own `unwrap_model_for_generation`. Each rank needs the whole model's room. The 0.5B test's
    evaluation on 2 CPU ranks: 14 s, 69 s with a gather per layer per token. Yields `value`."""
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    engine.empty_partition_cache()  # what evaluation's forwards left gathered or in flight
    with unwrap_model_for_generation(engine):
        yield value


def share_fp32_master(engine) -> int:
    """ZeRO-3 in fp32: let the optimizer step the fp32 partition itself, as DeepSpeed means to; returns the bytes
    freed (4Ψ/N). stage3.py's `_create_fp32_partitions` keeps no master copy when the partition is already fp32 on
    its device, but it compares a `torch.device` with a string (`"cpu"`, `"cuda:0"`), which is never equal, so it
    clones one. Each master's storage becomes its partition's (the optimizer keeps the same tensor objects, and the
    copy back after each step copies a tensor onto itself). No-op with 16-bit weights, offload or stages 0-2.
    A patch of DeepSpeed's internals (no public API sets the master copy), read directly: a renamed attribute raises."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() != 3 or opt.offload_optimizer or opt.offload_param:
        return 0
    freed = 0
    for part, master in zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat):
        if (part.dtype == master.dtype and part.device == master.device and part.shape == master.shape
                and part.untyped_storage().data_ptr() != master.untyped_storage().data_ptr()):
            freed += master.untyped_storage().nbytes()
            master.data = part.data
    return freed


# The private attributes of DeepSpeed's optimizer that held_bytes and GradPeak count with, by ZeRO stage, as DeepSpeed
# 0.19 names them. Checked before they are read: a version that renames one fails naming it, instead of counting 0.
READS = {
    0: ("fp32_groups", "optimizer"),  # 16-bit weights: FP16_UnfusedOptimizer (fp32: the torch optimizer itself)
    1: ("single_partition_of_fp32_groups", "cpu_offload", "optimizer", "averaged_gradients", "grads_in_partition",
        "offload_gradient_dict"),
    3: ("fp32_partitioned_groups_flat", "offload_param", "offload_optimizer", "optimizer", "grad_partitions_flat_buffer"),
}
READS[2] = READS[1]


def check_reads(engine) -> None:
    """Raise `AttributeError` naming what `READS` expects and this DeepSpeed's optimizer lacks."""
    import deepspeed

    opt, stage = engine.optimizer, engine.zero_optimization_stage()
    names = () if isinstance(opt, torch.optim.Optimizer) else READS[stage]
    missing = [name for name in names if not hasattr(opt, name)]
    if stage == 3 and not all(hasattr(p, "ds_tensor") for p in engine.module.parameters()):
        missing.append("ds_tensor (of each parameter)")
    if missing:
        raise AttributeError(f"DeepSpeed {deepspeed.__version__}: ZeRO-{stage}'s {type(opt).__name__} has no "
                             f"{', '.join(missing)}, which course_lib.parallel.zero counts a rank's bytes with (written for "
                             f"DeepSpeed 0.19): update READS and held_bytes for this version")


def held_bytes(engine) -> dict:
    """Bytes of parameters, gradients and optimizer state this rank holds, and where.

    params: the 16-bit (or fp32) weights the model computes with: whole on stages 0-2, this rank's
    partition (`param.ds_tensor`) on stage 3. optimizer: the fp32 master weights (unless they are the
    weights' own storage) plus the optimizer's own state (AdamW's two moments and step counters). grads: see `gradient_tensors`.
    `host` counts the bytes DeepSpeed places in the offload tier (CPU memory), by its own placement rule read
    from its offload flags, not from the tensors' devices, so a CPU-only machine (one memory) reports what a
    GPU machine holds: offloaded parameter partitions, the optimizer's fp32 state, the fp32 gradient copies
    of ZeRO-1/2's offload (with accumulation also its pinned 16-bit gradient buffers), and ZeRO-3's gradient partition buffer, which optimizer offload allocates on the
    host (pinned) for the CPU optimizer to read.
    """
    check_reads(engine)
    opt = engine.optimizer
    params = list(engine.module.parameters())
    stage = engine.zero_optimization_stage()
    host_grads = []
    if isinstance(opt, torch.optim.Optimizer):  # fp32 without ZeRO: no wrapper, no master copy
        weights, master, inner, offload_params, offload_opt = params, [], opt, False, False
    elif stage == 3:
        weights, master, inner = [p.ds_tensor for p in params], _flat(opt.fp32_partitioned_groups_flat), opt.optimizer
        offload_params, offload_opt = bool(opt.offload_param), bool(opt.offload_optimizer)
        if offload_opt:  # stage3.py: the buffer lives on `self.device`, the CPU under optimizer offload
            host_grads = _flat(opt.grad_partitions_flat_buffer)
    elif stage:  # 1-2: the fp32 partition, and under offload the fp32 gradient copies on the host
        weights, master, inner = params, _flat(opt.single_partition_of_fp32_groups), opt.optimizer
        offload_params, offload_opt, host_grads = False, bool(opt.cpu_offload), _flat(opt.offload_gradient_dict)
        # with accumulation, offload also keeps a pinned 16-bit copy of each whole parameter's gradient in the rank's
        # range, created at its first use and kept (stage_1_and_2.py, `accumulated_grads_in_cpu`)
        host_grads += list(getattr(opt, "accumulated_grads_in_cpu", {}).values()) if offload_opt else []
    else:  # 0 with 16-bit weights: the wrapper's fp32 copies
        weights, master, inner, offload_params, offload_opt = params, _flat(opt.fp32_groups), opt.optimizer, False, False
    grads = gradient_tensors(engine)
    # a master that shares its storage with the weights (fp32 ZeRO-3 after `share_fp32_master`) is counted once, as weights
    grads = grads + host_grads  # tensor_bytes counts a storage once; the accumulation buffers are only in host_grads
    out = {"params": tensor_bytes(weights), "grads": tensor_bytes(grads),
           "optimizer": tensor_bytes(weights + master + optimizer_state_tensors(inner)) - tensor_bytes(weights)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["host"] = ((out["params"] if offload_params else 0) + (out["optimizer"] if offload_opt else 0)
                   + tensor_bytes(host_grads))
    out["device"] = out["total"] - out["host"]
    return out


class GradPeak:
    """The most gradient bytes held at any moment of backward, sampled after each gradient lands.

        peak = GradPeak(engine)           # once, after deepspeed.initialize
        peak.phase = "first"              # samples go to peak.bytes["first"] ...
        engine.backward(loss)

    ZeRO-1 reduces gradients only at the end of backward, so the full 16-bit gradient exists then
    (the paper's 2Ψ); ZeRO-2/3 reduce bucket by bucket during backward, so the peak is the partition
    plus what is in flight (bounded by reduce_bucket_size and the largest parameter). Name a phase per
    micro-batch to tell one backward from the later ones of gradient accumulation, which also hold
    the gradients accumulated so far.
    """

    def __init__(self, engine):
        check_reads(engine)
        self.engine, self.phase, self.bytes = engine, "backward", {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook)
                       for p in engine.module.parameters() if p.requires_grad]

    def _hook(self, _param) -> None:
        self.sample()

    def sample(self) -> int:
        now = tensor_bytes(gradient_tensors(self.engine))
        self.bytes[self.phase] = max(self.bytes.get(self.phase, 0), now)
        return now

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
