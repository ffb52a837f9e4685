"""The SFT recipe's fine-tune done with Hugging Face `Trainer`, as a careful practitioner configures it: the
reference the benchmark (`python -m course_lib.workbook.bench`, chapter 10 section 6) measures `sft.py` against.

    python sft_trainer.py --model-path DIR --data-dir chats/ --out-dir runs/trainer        # one process
    torchrun --nproc-per-node=2 sft_trainer.py ...                                         # DDP (Trainer's own)

The same checkpoint directory, data files, tokenization and loss mask as `sft.py` (course_lib/sft/data.py), the same
AdamW (Trainer's default, `adamw_torch_fused`), learning rate, warmup + cosine to the same floor, clipping and
examples per optimizer step. On top of Trainer's defaults: length-grouped sampling, bf16 where the hardware has
it natively, and the padding-free collator (`DataCollatorWithFlattening`) where the installed transformers has
one. Per optimizer step it records what `sft.py` records (seconds, CPU seconds, tokens processed, target tokens,
loss); after training, the held-out loss with `sft.py`'s own loss function, on the same held-out rows.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

import course_lib as cl
from course_lib.sft import data as D
from course_lib.config import ConfigError, opt
from course_lib.recipes import sft


@dataclass
class Config(sft.ChatRun):
    """The SFT fine-tune with Hugging Face Trainer: the benchmark's reference (chapter 10)."""

    out_dir: str = opt(None, "Trainer's output directory (nothing is saved there but its logs)", required=True)
    steps: int = opt(500, "optimizer steps")
    micro_batch: int = opt(4, "sequences per rank per micro-batch (per_device_train_batch_size)")
    accum: int = opt(1, "micro-batches accumulated per optimizer step")
    lr: float = opt(2e-5, "peak learning rate")
    warmup: int | None = opt(None, "warmup steps (default: 10% of --steps)")
    min_lr_ratio: float = opt(0.1, "cosine floor, as a fraction of --lr")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    clip: float = opt(1.0, "max global gradient norm")
    seq_len: int = opt(2048, "truncate sequences to this many tokens")
    precision: str = opt("auto", "auto (bf16 where the hardware has native bf16, else fp32), fp32 or bf16")
    padding_free: bool = opt(True, "DataCollatorWithFlattening where transformers has it (else padded batches)")
    group_by_length: bool = opt(True, "length-grouped sampling (Trainer's LengthGroupedSampler)")
    fsdp: bool = opt(False, "Trainer's FSDP (fsdp='full_shard', version 2)")
    torch_compile: bool = opt(False, "Trainer's own torch.compile of the whole model (TrainingArguments.torch_compile)")
    eval_n: int = opt(200, "held-out conversations scored after training (0: none)")
    seed: int = opt(0, "Trainer's seed (its data order)")
    threads: int | None = opt(None, "torch CPU threads per rank")
    timeout: float = opt(600.0, "seconds a collective waits for the other ranks")

    def check(self) -> None:
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"--precision must be auto, fp32 or bf16, got {self.precision!r}")
        for name in ("steps", "micro_batch", "accum", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


def from_sft(cfg: sft.Config, **overrides) -> Config:
    """The Trainer config of the same fine-tune as the recipe's `cfg` (every field both have)."""
    shared = {f.name for f in fields(Config)} & {f.name for f in fields(sft.Config)} - {"padding_free"}
    return Config(**{**{k: getattr(cfg, k) for k in shared}, "lr": cfg.peak_lr(), **overrides})


class Counting:
    """The collator, remembering per micro-batch the tokens processed (padding included) and the target tokens."""

    def __init__(self, collate):
        self.collate, self.counts = collate, {"batch_tokens": [], "tokens": [], "targets": []}

    def __call__(self, rows):
        batch = self.collate(rows)
        mask = batch.get("attention_mask")
        for key, n in zip(self.counts, (batch["input_ids"].numel(), int(mask.sum()) if mask is not None
                                        else batch["input_ids"].numel(), cl.train.count_targets(batch))):
            self.counts[key].append(n)
        return batch


def collator(cfg: Config, pad_id: int):
    """(collate function, its name): transformers' padding-free one if asked and installed, else padded batches."""
    import transformers

    if cfg.padding_free and hasattr(transformers, "DataCollatorWithFlattening"):
        return transformers.DataCollatorWithFlattening(return_tensors="pt"), "DataCollatorWithFlattening"
    return functools.partial(D.collate, pad_id=pad_id), "padded (course_lib.sft.data.collate)"


def training_arguments(cfg: Config, bf16: bool):
    from transformers import TrainingArguments

    kw = dict(output_dir=cfg.out_dir, per_device_train_batch_size=cfg.micro_batch, gradient_accumulation_steps=cfg.accum,
              max_steps=cfg.steps, learning_rate=cfg.lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.clip,
              warmup_steps=cfg.warmup if cfg.warmup is not None else cfg.steps // 10,
              lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": cfg.min_lr_ratio},
              seed=cfg.seed, bf16=bf16, use_cpu=not torch.cuda.is_available(), logging_steps=1, save_strategy="no",
              report_to="none", disable_tqdm=True, torch_compile=cfg.torch_compile)
    if cfg.group_by_length:  # transformers >= 5.x names it a sampling strategy; older ones a flag
        has_strategy = "train_sampling_strategy" in TrainingArguments.__dataclass_fields__
        kw.update(train_sampling_strategy="group_by_length") if has_strategy else kw.update(group_by_length=True)
    if cfg.fsdp:
        kw.update(fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]})
    return TrainingArguments(**kw)


def train(cfg: Config) -> dict:
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback

    ctx = cl.dist.init(timeout_s=cfg.timeout)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tokenizer = cl.model_dir.load_tokenizer(cfg.model_path)
    train_chats, held_out, _ = sft.read_split(cfg)
    rows, stats = D.tokenize_chats(train_chats, tokenizer, cfg.seq_len)
    eval_rows = D.tokenize_chats(held_out, tokenizer, cfg.seq_len)[0] if held_out else []
    bf16 = {"auto": cl.native_bf16(ctx.device), "bf16": True, "fp32": False}[cfg.precision]
    model = cl.model_dir.load_weights(cfg.model_path)
    n_params = sum(p.numel() for p in model.parameters())
    collate, collate_name = collator(cfg, tokenizer.pad_token_id)
    counting = Counting(collate)
    marks, losses = [], []

    class Clock(TrainerCallback):  # wall and CPU time at the start and at the end of every optimizer step
        def on_train_begin(self, args, state, control, **kw):
            marks.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, args, state, control, **kw):
            marks.append((time.perf_counter(), time.process_time()))

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    args = training_arguments(cfg, bf16)
    # with --torch-compile, dynamic shapes (accelerate's dynamo setting, read while Trainer builds its accelerator):
    # one graph for every batch length, as the recipe's --compile does, instead of one compilation per length
    with cl.env.environ(ACCELERATE_DYNAMO_USE_DYNAMIC="1" if cfg.torch_compile else None):
        trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows), data_collator=counting,
                          callbacks=[Clock()])
    rss = {"loaded": cl.peak_rss_bytes()}
    trainer.train()
    rss["trained"] = cl.peak_rss_bytes()
    steps = len(marks) - 1
    per_step = lambda xs: [sum(xs[i * cfg.accum:(i + 1) * cfg.accum]) for i in range(steps)]  # noqa: E731
    autocast = functools.partial(torch.autocast, ctx.device.type, dtype=torch.bfloat16, enabled=bf16)
    eval_loss = cl.evaluation.held_out_loss(trainer.model, eval_rows, sft.sft_loss, cfg.micro_batch,
                                            tokenizer.pad_token_id, ctx, autocast)
    gathered = cl.dist.gather({k: per_step(v) for k, v in counting.counts.items()}, ctx)  # every rank's, per step
    return {"backend": f"trainer ({trainer.accelerator.distributed_type.value.lower()})", "world_size": ctx.world_size,
            "precision": "bf16" if bf16 else "fp32", "params": n_params, "data": stats, "collator": collate_name,
            "sampler": "group_by_length" if cfg.group_by_length else "random", "optim": args.optim.value
            if hasattr(args.optim, "value") else str(args.optim), "step": list(range(1, steps + 1)), "loss": losses,
            "seconds": [b[0] - a[0] for a, b in zip(marks, marks[1:])],
            "cpu_seconds": [b[1] - a[1] for a, b in zip(marks, marks[1:])],
            **{k: [sum(g[k][i] for g in gathered) for i in range(steps)] for k in counting.counts},
            "eval": [{"step": steps, "loss": eval_loss}], "peak_rss_per_rank": cl.dist.gather(cl.peak_rss_bytes(), ctx),
            "rss_phases_per_rank": cl.dist.gather(rss, ctx), "cuda_peak_per_rank": cl.dist.gather(cl.cuda_peak_bytes(), ctx)}


def main(argv=None) -> dict:
    cl.env.deepspeed_told_no_gpu()
    cfg = Config.parse(argv)
    try:
        result = train(cfg)
    except (D.ChatFormatError, FileNotFoundError, ConfigError) as e:
        raise SystemExit(f"sft_trainer.py: error: {e}") from None
    cl.dist.finish(result)
    return result


if __name__ == "__main__":
    main()
    cl.dist.exit_now()  # (skips the interpreter's teardown: see exit_now)
