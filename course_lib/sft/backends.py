"""Backends: the one place where one process, DDP, FSDP2 and DeepSpeed ZeRO differ in a training loop.

The SFT recipe (course_lib/recipes/sft.py, chapter 10) runs one loop; a backend, picked from its config,
does what differs, behind one interface (the strategy pattern, as torchtitan's `apply_*` functions):

    backend = backends.make(cfg, ctx)          # Single, DDP, FSDP2 or DeepSpeed
    model = backend.load_model(cfg.model_path) # FSDP2: on the meta device (setup shards it, rank 0's read fills
                                               # it); ZeRO-3: partitioned as it is built, filled from rank 0's read
    backend.setup(model)                       # wrap (data_parallel.apply_ddp, fsdp2.shard_model, zero.initialize),
                                               # optimizer, schedule
    with backend.sync(last), backend.autocast():
        loss = loss_fn(backend.model, batch)   # call the wrapper; backend.module is the plain model
    backend.backward(loss); backend.step()     # (unscale,) clip, step, schedule; returns the gradient norm
                                               # (DeepSpeed's engine steps inside backward, at the last micro-batch)
    backend.save(path, meta) / backend.resume(path) / backend.export(path, tokenizer)

Subclass one to measure or change a step (chapter 11's capstone does): no monkeypatching. `recipe_plan` and
`measured_vs_predicted` put a run of the recipe into the memory model (`cl.memory.step_memory`).
Chapters 05 (DDP), 06 (ZeRO), 07 (FSDP2) explain each strategy; chapter 10 uses them all.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from . import checkpoint, model_dir, speed
from ..parallel import data_parallel, fsdp2
from ..parallel import precision as mixed
from ..env import native_bf16
from ..memory import LORA_DIMS, step_memory
from .train import warmup_cosine


def attention(cfg) -> dict:
    """`from_pretrained`'s attention kernel where the config names one (the SFT recipe's `--attn`), else its default."""
    return {"attn_implementation": cfg.attn} if getattr(cfg, "attn", None) else {}


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_precision(precision: str, device) -> str:
    """What `--precision` means on this device: `auto` is bf16 where the hardware has native bf16, else fp32
    (fp16 is never picked for you: it needs a loss scale, and an fp32 run on a CPU without bf16 is the safer
    default); bf16, fp16 and fp32 are themselves."""
    return ("bf16" if native_bf16(device) else "fp32") if precision == "auto" else precision


def decay_groups(params, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: weight decay on the matrices (the linear layers' weights, the embedding), none on
    the biases and the norms' scales (one number per channel), as GPT-2's training and HF Trainer do. Without
    decay, one group, as a run without groups has (so either's checkpoints resume the other)."""
    if not weight_decay:
        return [{"params": list(params)}]
    params = list(params)
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # LoRA trains matrices only


class Single:
    """One process: no wrapping, no gradient sync. The base of the others."""

    name = "single"
    autocasts = True  # 16-bit by autocast over fp32 weights (DeepSpeed holds 16-bit weights itself instead)

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx
        self.precision = resolve_precision(cfg.precision, ctx.device)  # bf16, fp16 or fp32
        self.model = self.module = self.optimizer = self.scheduler = self.scaler = None

    # --- the model comes to this rank ----------------------------------------------------------------
    def load_model(self, path):
        """The model of a checkpoint directory: here the whole model, fp32 master weights, on every rank. With
        `lora`, a base that stays frozen in the run's precision (`cfg.base_dtype`: bf16 where it computes in bf16,
        as peft users load it); with `qlora`, the frozen base in 4-bit NF4 (bitsandbytes, on the GPU) and bf16
        compute."""
        if not getattr(self.cfg, "qlora", False):
            dtype = DTYPES[self.cfg.base_dtype(self.precision)]
            return model_dir.load_weights(path, dtype=dtype, **attention(self.cfg))
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
        model = model_dir.load_weights(path, dtype=torch.bfloat16, quantization_config=quant, **attention(self.cfg),
                                       device_map={"": self.ctx.device.index or 0})
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=self.cfg.act_ckpt)

    def generation(self, gather: bool = True):
        """A context around `self.module.generate(...)`; it yields generate's extra arguments. Unsharded: none.
        Sharded (FSDP2, ZeRO-3): every rank steps together and, with `gather`, the model is gathered once for it."""
        return contextlib.nullcontext({})

    # --- wrap, optimizer, schedule -------------------------------------------------------------------
    def setup(self, model) -> None:
        if getattr(model, "hf_quantizer", None) is None and not next(model.parameters()).is_meta:
            model.to(self.ctx.device)  # (a 4-bit model is already where it computes; a meta one is sharded first)
        self.module, self.model = model, self.wrap(model)
        self.optimizer = self.make_optimizer(decay_groups([p for p in model.parameters() if p.requires_grad],
                                                          self.cfg.weight_decay))
        self.scheduler = self.make_schedule(self.optimizer)
        if self.precision == "fp16":  # fp16's narrow range: the loss scaled up, the gradients unscaled before the step
            self.scaler = self.make_scaler()

    def make_scaler(self):
        """The dynamic loss scale of an fp16 run (chapter 01's `cl.precision.grad_scaler`): it halves when a step's
        gradients overflow (that step is skipped) and doubles after 2,000 clean steps."""
        return mixed.grad_scaler(self.ctx.device, torch.float16)

    def wrap(self, model):
        return model

    def make_optimizer(self, params):
        # the fused AdamW kernel (one op per tensor, not ~10): HF Trainer's default too (`--optim-impl` picks another)
        return torch.optim.AdamW(params, lr=self.cfg.peak_lr(), weight_decay=self.cfg.weight_decay,
                                 **speed.adamw_kernel(self.cfg, "fused"))

    def make_schedule(self, optimizer):
        cfg = self.cfg
        warmup = cfg.warmup if cfg.warmup is not None else cfg.steps // 10
        return warmup_cosine(optimizer, warmup, cfg.steps, cfg.min_lr_ratio)

    # --- one step ------------------------------------------------------------------------------------
    def autocast(self):
        """bf16 or fp16 autocast over fp32 master weights where asked (chapter 01's `cl.precision.autocast`), else
        nothing."""
        return mixed.autocast(self.ctx.device, DTYPES[self.precision] if self.autocasts else torch.float32)

    def sync(self, last: bool):
        """Gradients are averaged over ranks only on the last micro-batch of an accumulation."""
        return contextlib.nullcontext()

    def backward(self, loss) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> float:
        """(Unscale,) clip, step, advance the schedule; return the global gradient norm before clipping. fp16: a
        step whose gradients overflowed is skipped and its norm is inf or nan (the loss scale halves)."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # the true gradients, for the norm and the clip
        # --clip 0: no clipping (as in HF Trainer and DeepSpeed); clip_grad_norm_ would take a max norm of 0 literally
        # and zero every gradient. An infinite one measures the norm and changes nothing.
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip or math.inf)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
        if self.scaler:
            self.scaler.step(self.optimizer)  # skipped where a gradient is inf or nan
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return float(norm)

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # --- checkpoints and export ----------------------------------------------------------------------
    def save(self, path: Path, meta: dict) -> None:
        """An atomic checkpoint of everything the run needs to continue (collective): fp16's loss scale too."""
        scaler = {"scaler": self.scaler.state_dict()} if self.scaler else {}
        checkpoint.save_sharded(path, self.module, self.optimizer,
                                meta={**meta, "scheduler": self.scheduler.state_dict(), **scaler})

    def resume(self, path: Path) -> dict:
        """Load a checkpoint written by `save`; return its metadata (the step, ...)."""
        meta = checkpoint.load_sharded(self._found(path), self.module, self.optimizer)
        self.scheduler.load_state_dict(meta["scheduler"])
        if self.scaler and "scaler" in meta:
            self.scaler.load_state_dict(meta["scaler"])
        return meta

    @staticmethod
    def _found(path: Path) -> Path:
        found = checkpoint.resolve(path)
        if found is None:
            raise SystemExit(f"--resume {path}: no complete checkpoint there")
        return found

    def export(self, path: Path, tokenizer) -> None:
        """The fine-tuned model as a Hugging Face directory (`from_pretrained` loads it), in `--export-dtype`
        (bf16 by default, as Qwen2.5 ships), laid out as the checkpoint it was loaded from: its tensor names (a
        tied head stored once), its `use_cache`, its generation_config.json (`checkpoint.save_pretrained`), on
        every backend. Collective. LoRA: see `checkpoint.export_lora`."""
        if checkpoint.is_peft(self.module):
            checkpoint.export_lora(self.module, self.cfg, path, tokenizer, self.ctx.is_main, self.export_meta())
            return
        checkpoint.save_full(path, self.module, meta=self.export_meta(), dtype=self.export_dtype(),
                             source=self.cfg.model_path, tokenizer=tokenizer)

    def export_dtype(self):
        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.cfg.export_dtype]

    def export_meta(self) -> dict:
        return {"from": str(self.cfg.model_path), "dtype": self.cfg.export_dtype}

    def close(self) -> None:
        """Free what the backend holds beyond the model (DeepSpeed's engine)."""


class DDP(Single):
    """DistributedDataParallel: the whole model on every rank, gradients all-reduced in buckets (chapter 05)."""

    name = "ddp"

    def wrap(self, model):
        # gradient_as_bucket_view: the gradients live in DDP's communication buckets, not beside them (-4Ψ bytes)
        return data_parallel.apply_ddp(model, self.ctx.device, gradient_as_bucket_view=True)

    def sync(self, last: bool):
        return contextlib.nullcontext() if last else self.model.no_sync()


class FSDP2(Single):
    """`fully_shard` per decoder layer, then the root: parameters, gradients and AdamW state sharded (chapter 07).

    The model never exists whole on a rank: it is built on the meta device (shapes, no memory), sharded, then
    each rank allocates only its shards and the checkpoint fills them: rank 0 reads the safetensors and
    broadcasts one tensor at a time (`set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)`).
    bf16 is FSDP2's own mixed precision: bf16 weights gathered and computed with, fp32 gradients reduced and
    fp32 shards stepped (`MixedPrecisionPolicy`), instead of autocast over fp32 all-gathers (chapter 07); fp16 the
    same, with a loss scale that reads every rank's shards (`ShardedGradScaler`)."""

    name = "fsdp"

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.autocasts = False  # bf16 or fp16, when asked, is the MixedPrecisionPolicy below

    def load_model(self, path):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.path = model_dir.check_model_dir(path)
        config = AutoConfig.from_pretrained(self.path, local_files_only=True)
        config.use_cache = False
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attention(self.cfg))

    def wrap(self, model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.ctx.world_size == 1:
            raise SystemExit("--fsdp needs several ranks: launch with torchrun --nproc-per-node=N")
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[self.precision], reduce_dtype=torch.float32) \
            if self.precision != "fp32" else None
        model = fsdp2.shard_model(model, init_device_mesh(self.ctx.device.type, (self.ctx.world_size,)), mp_policy=policy)
        if next(model.parameters()).is_meta:
            model.to_empty(device=self.ctx.device)  # this rank's shards only, uninitialized
            fsdp2.fill_from_rank0(model, self.path if self.ctx.is_main else None, self.ctx.device)
        return model

    def make_optimizer(self, params):
        # FSDP2's DTensors: the foreach kernel by default (`--optim-impl fused` measures the other)
        return torch.optim.AdamW(params, lr=self.cfg.peak_lr(), weight_decay=self.cfg.weight_decay,
                                 **speed.adamw_kernel(self.cfg, "foreach"))

    def make_scaler(self):
        # one overflow on one rank's shard skips the step on every rank: the scaler all-reduces its inf check
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.ctx.device.type)

    def sync(self, last: bool):
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def generation(self, gather: bool = True):
        synced = {"synced_gpus": True}
        return fsdp2.gathered(self.module, synced) if gather else contextlib.nullcontext(synced)


class DeepSpeed(Single):
    """A DeepSpeed engine from a ZeRO config (chapter 06): it steps, clips and checkpoints itself."""

    name = "deepspeed"
    autocasts = False  # the engine holds 16-bit weights itself (and scales fp16's loss): no autocast on top

    def ds_config(self, hidden_size: int) -> dict:
        from ..parallel import zero

        cfg = self.cfg
        return zero.prepare(cfg.deepspeed, self.ctx.world_size, micro_batch=cfg.micro_batch, accum_steps=cfg.accum,
                            hidden_size=hidden_size, lr=cfg.peak_lr(), weight_decay=cfg.weight_decay,
                            max_grad_norm=cfg.clip, precision=self.precision)

    def load_model(self, path):
        """ZeRO-1/2: the whole model on every rank. ZeRO-3: partitioned while it is built (`zero.Init`, which
        transformers uses while an `HfDeepSpeedConfig` of a stage-3 config is alive), each rank holding 1/N, then
        filled one parameter at a time from rank 0's read of the checkpoint (`cl.zero.fill_from_rank0`)."""
        import json

        from ..parallel import zero

        zero.no_jit()
        hidden = json.loads((model_dir.check_model_dir(path) / "config.json").read_text())["hidden_size"]
        self.config = self.ds_config(hidden)
        if self.config.get("zero_optimization", {}).get("stage") == 3:
            import deepspeed
            from transformers.integrations.deepspeed import HfDeepSpeedConfig

            from transformers import AutoConfig, AutoModelForCausalLM

            deepspeed.init_distributed()  # zero.Init reads the world size from DeepSpeed's (wrapped) process group
            self._hf_ds_config = HfDeepSpeedConfig(self.config)  # alive: transformers builds under zero.Init
            config = AutoConfig.from_pretrained(model_dir.check_model_dir(path), local_files_only=True)
            config.use_cache = False
            with zero.without_random_init():  # every weight comes from the checkpoint next
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,  # partitioned as it is built
                                                         **attention(self.cfg))
            zero.fill_from_rank0(model, path if self.ctx.is_main else None)
            return model
        return super().load_model(path)

    def setup(self, model) -> None:
        import deepspeed

        from ..parallel import zero

        if not hasattr(self, "config"):
            self.config = self.ds_config(model.config.hidden_size)
        if not getattr(self, "_hf_ds_config", None):
            model.to(self.ctx.device)
        elif getattr(self.cfg, "loss_chunk", 0):  # ZeRO-3: the loss in forward reads the head's weight: fetch it there
            deepspeed.zero.register_external_parameter(model, model.get_output_embeddings().weight)
        self.engine, self.optimizer, self.scheduler = zero.initialize(
            model, self.config, decay_groups([p for p in model.parameters() if p.requires_grad], self.cfg.weight_decay),
            lr_scheduler=self.make_schedule, share_master=True)  # ZeRO-3 in fp32: no master copy beside the partition
        self.model, self.module = self.engine, self.engine.module
        self.scaler = None  # fp16: the engine scales the loss itself (its config's "fp16" section)

    def backward(self, loss) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the recipe's loss is already weighted by its tokens
        self.engine.step()  # steps the optimizer (and schedule) only at the accumulation boundary

    def step(self) -> float:  # clipping and the step happened in engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def generation(self, gather: bool = True):
        if self.engine.zero_optimization_stage() != 3:  # ZeRO-1/2: every rank holds the whole model
            return contextlib.nullcontext({})
        from ..parallel import zero

        synced = {"synced_gpus": True}
        return zero.gathered(self.engine, synced) if gather else contextlib.nullcontext(synced)

    def save(self, path: Path, meta: dict) -> None:
        """As `Single`'s, what trains and its optimizer state: LoRA's frozen base is --model-path's, not saved."""
        with checkpoint.atomic_directory(path, {**meta, "scheduler": self.scheduler.state_dict()}) as tmp:
            self.engine.save_checkpoint(str(tmp), tag="state", exclude_frozen_parameters=self.has_frozen_weights())

    def resume(self, path: Path) -> dict:
        found = self._found(path)
        self.engine.load_checkpoint(str(found), tag="state", load_module_strict=not self.has_frozen_weights())
        return checkpoint.read_meta(found)

    def has_frozen_weights(self) -> bool:
        return any(not p.requires_grad for p in self.module.parameters())

    def export(self, path: Path, tokenizer) -> None:
        """ZeRO-3 gathers one parameter at a time into rank 0's CPU memory (never the whole model on a device)."""
        if checkpoint.is_peft(self.module):  # ZeRO-1/2: every rank holds the whole (LoRA) model
            checkpoint.export_lora(self.module, self.cfg, path, tokenizer, self.ctx.is_main, self.export_meta())
            return
        from ..parallel import zero

        if self.engine.zero_optimization_stage() == 3:
            # evaluation and generation run the model outside the engine's step: DeepSpeed's prefetcher can leave
            # parameters gathered or in flight, which GatheredParameters refuses to partition again (0.5B shape)
            self.engine.empty_partition_cache()
            state = zero.gathered_state_dict(self.module, self.export_dtype(), self.ctx.is_main)
        else:  # (a tied head is the embedding: not copied twice)
            tied = checkpoint.aliases(self.module)
            state = {k: v.detach().to("cpu", self.export_dtype()) for k, v in self.module.state_dict().items()
                     if k not in tied} if self.ctx.is_main else {}
        with checkpoint.atomic_directory(path, self.export_meta()) as tmp:
            if self.ctx.is_main:
                checkpoint.save_pretrained(self.module, tmp, state, self.export_dtype(), source=self.cfg.model_path)
                checkpoint.save_tokenizer(tokenizer, tmp)

    def close(self) -> None:
        self.engine.destroy()
        if getattr(self, "_hf_ds_config", None) is not None:  # later models load normally again
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
            self._hf_ds_config = None


def pick(cfg, ctx) -> type:
    """The backend class a config asks for: DeepSpeed with `deepspeed`, FSDP2 with `fsdp`, else DDP with
    several ranks, else one process."""
    if cfg.deepspeed:
        return DeepSpeed
    if cfg.fsdp:
        return FSDP2
    return DDP if ctx.world_size > 1 else Single


def make(cfg, ctx) -> Single:
    """The default backend factory: `pick(cfg, ctx)(cfg, ctx)`."""
    return pick(cfg, ctx)(cfg, ctx)


# --- the memory model on a run of the recipe: `step_memory` with the backend and precision as the recipe picks
# them, before anything loads (--memory-budget) and beside what a rank measured (--memory-trace) ---------------
def recipe_plan(shape, cfg, ranks: int, native_bf16: bool) -> dict:
    """`step_memory` for an SFT recipe config (course_lib/recipes/sft.py) on `ranks` ranks, at its worst micro-batch:
    --seq-len tokens each, every position trained. Its backend and precision as the recipe picks them."""
    if cfg.fsdp:
        backend = "fsdp2"
    elif cfg.deepspeed:
        from ..parallel import zero

        backend = f"zero{zero.stage(cfg.deepspeed)}"
    else:
        backend = "ddp" if ranks > 1 else "single"
    computes = cfg.precision if cfg.precision != "auto" else "bf16" if native_bf16 else "fp32"
    precision = recipe_precision(computes, backend)
    plan = step_memory(shape, backend=backend, ranks=ranks, precision=precision, seq=cfg.seq_len,
                       micro_batch=cfg.micro_batch, checkpointing=cfg.act_ckpt, **recipe_lora(cfg, computes))
    return {**plan, "backend": backend, "precision": precision}


def recipe_precision(computes: str, backend: str) -> str:
    """`step_memory`'s precision for an SFT recipe run that computes in `computes` (bf16, fp16 or fp32) on
    `backend`: autocast over fp32 weights on one process or DDP ("bf16-autocast"; fp16's autocast holds the same
    bytes), 16-bit weights with fp32 masters under FSDP2 and ZeRO ("bf16-mixed", "fp16-mixed")."""
    if computes == "fp32":
        return "fp32"
    return "bf16-autocast" if backend in ("single", "ddp") else f"{computes}-mixed"


def recipe_lora(cfg, computes: str) -> dict:
    """`step_memory`'s LoRA arguments for an SFT recipe config that computes in `computes` (bf16, fp16 or fp32):
    the rank, the adapted projections (`all-linear`: the seven), the dropout and the bytes of a frozen base weight
    (`cfg.base_dtype`: 2 where the run computes in 16 bits); none without LoRA. (QLoRA's 4-bit base is not
    modelled: the precision's.)"""
    if not (cfg.lora or cfg.qlora):
        return {}
    targets = tuple(LORA_DIMS) if cfg.lora_targets == "all-linear" else tuple(cfg.lora_targets.split(","))
    return {"lora_r": cfg.lora_r, "lora_targets": targets, "lora_dropout": cfg.lora_dropout,
            "base_bytes": None if cfg.qlora else DTYPES[cfg.base_dtype(computes)].itemsize}


def measured_vs_predicted(tracer, backend, config, micro: list[dict], checkpointing: bool = False, **lora) -> dict:
    """One rank's measured peak of live tensor bytes in a step (`tracer`: a `cl.LiveTensorBytes` that watched
    it), by category and phase, beside what `step_memory` predicts for the same step: the backend (a
    backend here), ranks, precision, the largest micro-batch's padded shape and its trained
    positions (the rows the SFT recipe projects onto the vocabulary); `lora`: `recipe_lora`'s arguments. The SFT
    recipe's `--memory-trace`."""
    name = {"fsdp": "fsdp2"}.get(backend.name, backend.name)
    if name == "deepspeed":
        name = f"zero{backend.engine.zero_optimization_stage()}"
    precision = recipe_precision(backend.precision, name)
    rows = max(int((mb["labels"][..., 1:] != -100).sum()) for mb in micro)
    batch, seq = max((tuple(mb["input_ids"].shape) for mb in micro), key=lambda bs: bs[0] * bs[1])
    ds_adamw = getattr(backend, "config", {}).get("optimizer", {}).get("params", {})  # DeepSpeed's: torch's AdamW
    fused = name in ("single", "ddp") or ds_adamw.get("fused")
    kernel = "fused" if fused else "tensor" if backend.ctx.device.type == "cpu" else "foreach"
    live = getattr(backend, "config", {}).get("zero_optimization", {}).get("stage3_max_live_parameters", 1e9) \
        if name == "zero3" else 1e8
    predicted = step_memory(config, backend=name, ranks=backend.ctx.world_size, precision=precision, seq=seq,
                            micro_batch=batch, checkpointing=checkpointing, logit_rows=rows, optimizer_kernel=kernel,
                            zero3_live=live, device=backend.ctx.device.type, watched=True, **lora)
    return {"measured": tracer.peak, "by_category": tracer.peak_by_category(), "phases": tracer.phase_peaks(),
            "predicted": predicted["peak"], "predicted_parts": {k: v for k, v in predicted.items()
                                                                if isinstance(v, (int, float))},
            "predicted_phases": predicted["phases"], "backend": name, "precision": precision}
