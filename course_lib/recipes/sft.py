"""Supervised fine-tuning (SFT) of a Qwen2.5 checkpoint on chat data: chapter 10's recipe, runnable on a cluster.

    python sft.py --model-path Qwen2.5-0.5B-Instruct --data-dir chats/ --out-dir runs/sft     # one process
    torchrun --nproc-per-node=8 sft.py ...                                                  # DDP
    torchrun --nproc-per-node=8 sft.py ... --fsdp                                           # FSDP2 (fully_shard)
    deepspeed --num_gpus 8 sft.py ... --deepspeed zero3                                     # DeepSpeed ZeRO
    python sft.py ... --lora                  (or --qlora on a GPU)                         # LoRA adapters (peft)
    python sft.py export runs/sft/checkpoint-000200 --out exported/                         # a checkpoint, exported

The data directory holds `train.jsonl` and `eval.jsonl`, one conversation per line in the common `{"messages":
[{"role": "system"|"user"|"assistant", "content": ...}, ...]}` format (no `eval.jsonl`: a seeded tenth of
`train.jsonl`, at most `--eval-n` conversations, is held out; `--eval-split`: that fraction). `--data-dir` also
takes one file or a directory of them, JSONL, JSON arrays or parquet, rows in ShareGPT or prompt/completion format
too (course_lib/sft/data.py `as_messages`), or a hub dataset's name (`--data owner/name`, `datasets.load_dataset`);
`--config run.yaml` holds flags (course_lib/config.py). One code path: the same loop drives a plain module, DDP,
FSDP2 or a DeepSpeed engine; what differs is a backend (course_lib/sft/backends.py).

In order: check the config, the model directory and the data (a bad input ends in one `error:` line, before anything
is written); tokenize through the model's own chat template with the loss on every assistant turn (any template:
course_lib/sft/data.py; by rank 0 once, cached on disk by what it depends on), report what truncation cut; load the
model (fp32 master weights; with LoRA the frozen base in the run's precision, bf16 where it computes in bf16, and
fp32 adapters on the projections; QLoRA: a 4-bit base); train with AdamW, warmup + cosine, clipping (`--clip 0`:
none), accumulation (each micro-batch weighted by its share of target tokens over all ranks), bf16 autocast where
the hardware has native bf16, optional activation checkpointing, logits only where the loss looks, optional speed
paths (course_lib/sft/speed.py: padding-free rows, chunked loss in forward, compiled layers, prefetch); `--steps` or
`--epochs`; a log line every `--log-every` steps (loss, lr, gradient norm, real tokens a second, peak memory);
held-out loss and perplexity every `--eval-every` steps and at the end; the resolved settings in `config.json` at
the start and the run's figures in `metrics.json` at the end; atomic checkpoints after every 30 minutes of training
and at the end (`--save-every N`: every N steps; this run's last `--keep-last` kept, and with `--keep-best` the one
of the lowest held-out loss, which each records; what trains and its optimizer state: with LoRA the adapters, the
base being --model-path's), each recording the run's config and a fingerprint of what it continues (model, data,
global batch, schedule), and exact resume (`--resume`: a checkpoint of another run stops with one line unless
`--allow-mismatch`; a damaged latest one falls back to the one before); the model exported in bf16 safetensors that
`from_pretrained` loads, laid out as the checkpoint it came from (its tensors, `use_cache` and generation settings;
with LoRA: the adapter too, or with `--no-merge` the adapter only), then the final held-out loss, greedy samples and
exact match on held-out conversations (written to `samples.jsonl`). The data order and each step's random draws
(dropout) are functions of the step alone, so a resumed run sees the batches and draws the uninterrupted one would
have seen. Ctrl-C and a full disk end in one line too, the last complete checkpoint intact.

`sft.py export CHECKPOINT --out DIR` exports any checkpoint of a run, on one process: the directory the run's own
final export writes, had the run ended there (the run's settings come from the checkpoint's record).
"""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib
import importlib.util
import io
import json
import math
import os
import shutil
import sys
import time
import uuid
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

import course_lib as cl
from course_lib.sft import backends, data as D, speed
from course_lib.config import ConfigError, opt


DEFAULT_STEPS = 500
SAVE_SECONDS = 30 * 60  # the default checkpoint interval (no --save-every): minutes of training, not steps
WARMUP_RATIO = 0.1  # the default --warmup-ratio: a tenth of the steps
ATTENTION = ("sdpa", "eager", "flash_attention_2")


@dataclass
class ChatRun(cl.config.RecipeConfig):
    """What a fine-tune on chat data reads: this recipe's and Hugging Face Trainer's (`sft_trainer.py`)."""

    chapter = "10"
    model_path: str = opt(None, "local checkpoint directory (config.json, *.safetensors, tokenizer files)", required=True)
    data_dir: str = opt(None, "the data (--data too): a directory with train.jsonl and eval.jsonl (or .json arrays, "
                              ".parquet), a directory of such files, one file, or a dataset on the Hugging Face hub "
                              "(a name that is no local path: datasets.load_dataset(name), its train split, its test "
                              "or validation split held out); rows in messages, ShareGPT or prompt/completion format",
                        required=True, aliases=("--data",))
    eval_split: float | None = opt(None, "hold out this fraction of the training data (drawn by --seed) where there is "
                                         "no eval file; default: a tenth, at most --eval-n")


@dataclass
class Config(ChatRun):
    """Supervised fine-tuning (SFT) of a Qwen2.5 checkpoint on chat data: chapter 10's recipe."""

    out_dir: str = opt(None, "checkpoints, TensorBoard events, samples and the final model go here", required=True)
    steps: int | None = opt(None, "optimizer steps (or --epochs)")
    epochs: float | None = opt(None, "passes over the training rows, instead of --steps: the steps are the rows (after "
                                     "--pack) x epochs / global batch (--micro-batch x --accum x ranks), rounded up")
    micro_batch: int = opt(4, "sequences per rank per micro-batch")
    accum: int = opt(1, "micro-batches accumulated per optimizer step")
    lr: float | None = opt(None, "peak learning rate (default: 2e-5 full fine-tuning, 2e-4 with --lora/--qlora)")
    warmup: int | None = opt(None, "warmup steps (default: --warmup-ratio of the steps)")
    warmup_ratio: float = opt(WARMUP_RATIO, "warmup as a fraction of the steps, rounded down (--warmup N wins)")
    min_lr_ratio: float = opt(0.1, "cosine floor, as a fraction of --lr")
    weight_decay: float = opt(0.0, "AdamW weight decay, on the matrices only (none on biases and norms)")
    clip: float = opt(1.0, "max global gradient norm (0: no clipping)")
    seq_len: int = opt(2048, "truncate (or, with --pack, fill) sequences to this many tokens")
    pack: bool = opt(False, "join examples into full rows (no padding; attention stays inside each example)")
    data_cache: str | None = opt(None, "directory of tokenized data, keyed by the data, tokenizer, chat template and "
                                       "--seq-len: tokenized once by rank 0, read by every rank and later run "
                                       "(default: build/cache/tokenized; 'off': tokenize every time)")
    # the speed paths (course_lib/sft/speed.py), each measured alone by `python -m course_lib.workbook.bench`
    padding_free: bool = opt(False, "join each micro-batch's examples into one row, no padding (same examples, loss)")
    loss_chunk: int = opt(0, "N > 0: the loss inside forward, chunked cross-entropy over the trained positions only")
    compile: bool = opt(False, "torch.compile each decoder layer (dynamic shapes; the first step compiles)")
    prefetch: bool = opt(False, "make the next step's batches in a background thread")
    optim_impl: str = opt("auto", "AdamW kernel: auto (the backend's), fused, foreach or forloop")
    precision: str = opt("auto", "auto (bf16 autocast where the hardware has native bf16, else fp32), fp32, bf16, or "
                                 "fp16 with a dynamic loss scale (GPUs without bf16: V100, T4); with --lora also the "
                                 "dtype of the frozen base (--precision fp32: an fp32 base)")
    act_ckpt: bool = opt(False, "activation checkpointing (recompute each layer in backward)")
    attn: str = opt("sdpa", "attention kernel, from_pretrained's attn_implementation: sdpa, eager or "
                            "flash_attention_2 (a CUDA GPU and the flash-attn package)")
    deepspeed: str | None = opt(None, "DeepSpeed ZeRO config: a name in course_lib/parallel/configs or a .json path")
    fsdp: bool = opt(False, "shard with FSDP2 (fully_shard per decoder layer)")
    lora: bool = opt(False, "train LoRA adapters only (peft; fp32 adapters and AdamW state), the base weights frozen "
                            "(in bf16 where the run computes in bf16: --lora-base-dtype)")
    qlora: bool = opt(False, "LoRA on a 4-bit NF4 base (bitsandbytes; needs a CUDA GPU)")
    lora_r: int = opt(16, "LoRA rank")
    lora_alpha: float = opt(32.0, "LoRA scale numerator (the update is scaled by alpha / r)")
    lora_dropout: float = opt(0.05, "dropout on the LoRA branch")
    lora_targets: str = opt(",".join(cl.models.LORA_TARGETS), "comma-separated module names to adapt, or all-linear")
    lora_base_dtype: str = opt("auto", "dtype of LoRA's frozen base: auto (the run's precision: bf16 or fp16 where it "
                                       "computes in one, as peft users load it, 2 bytes a weight; else fp32) or fp32")
    merge: bool = opt(True, "LoRA's export: the merged model (from_pretrained loads it alone) beside final/adapter "
                            "(--no-merge: the adapter only, for PeftModel.from_pretrained on the base)")
    eval_n: int = opt(200, "held-out conversations scored (0: none); without eval.jsonl, up to this many (at most "
                           "10%) of train.jsonl's are held out, drawn by --seed")
    eval_every: int = opt(0, "held-out loss every N steps (0: only at the end)")
    eval_before: bool = opt(False, "also score the model before training")
    samples: int | None = opt(None, "held-out conversations answered greedily at the end for exact match and "
                                    "samples.jsonl (default: all that are scored; 0: none)")
    max_new_tokens: int = opt(16, "most tokens generated per sample (fewer where every reference answer is shorter)")
    gather_generate: bool = opt(True, "sharded: gather the whole model once to generate (needs its room on each rank)")
    save_every: int | None = opt(None, "checkpoint every N steps (0: only at the end). Default: at the first step that "
                                       "ends 30 minutes of training after the last checkpoint (or the start), and at "
                                       "the end: a Ctrl-C or a crash loses at most about 30 minutes whatever a step "
                                       "costs, each checkpoint's write is spread over 30 minutes of training, and a "
                                       "run shorter than that writes only its last checkpoint")
    save: bool = opt(True, "write checkpoints (--no-save: none at all, not even the last; e.g. a benchmark)")
    keep_last: int | None = opt(None, "keep only the N newest checkpoints (default: all)")
    keep_best: bool = opt(False, "score the held-out loss at every checkpoint (each records it) and keep the one with "
                                 "the lowest beside the --keep-last newest")
    resume: str | None = opt(None, "checkpoint directory to resume from ('auto': the latest of this run in --out-dir)")
    allow_mismatch: bool = opt(False, "resume from a checkpoint another run wrote (another model, data, batch or "
                                      "schedule: the resumed run is then not the one that wrote it)")
    halt_after: int | None = opt(None, "stop after this step, as if interrupted")
    export: bool = opt(True, "save the final model (--no-export: skip it)")
    export_dtype: str = opt("bf16", "dtype of the exported weights: bf16 (as Qwen2.5 ships) or fp32")
    memory_budget: float | None = opt(None, "GB per rank: stop before loading anything when the memory model "
                                            "(cl.memory.step_memory) predicts a larger peak")
    timeout: float = opt(600.0, "seconds a collective waits for the other ranks before the run fails (a frozen "
                                "or crashed rank ends the run instead of hanging it)")
    seed: int = opt(0, "seed of the data order (and of LoRA's initial adapters)")
    threads: int | None = opt(None, "torch CPU threads per rank")
    progress: bool = opt(True, "a progress bar on rank 0")
    log_every: int = opt(10, "a log line (step, epoch, loss, lr, grad norm, tokens/s, peak memory) and TensorBoard "
                             "scalars every N steps, and at the last")
    memory_trace: bool = opt(False, "count the last step's live tensor bytes (cl.LiveTensorBytes) beside the memory "
                                    "model's prediction (cl.memory.step_memory); slows that step, whose peak RSS "
                                    "is then reported apart")

    def __post_init__(self):
        if self.steps is not None and self.epochs is not None:
            raise ConfigError(f"give --steps or --epochs, not both (--steps {self.steps}, --epochs {self.epochs})")
        if self.steps is None and self.epochs is None:
            self.steps = DEFAULT_STEPS
        super().__post_init__()

    def check(self) -> None:
        if self.deepspeed and self.fsdp:
            raise ConfigError("choose one of --deepspeed and --fsdp")
        stage = None
        if self.deepspeed:  # a misspelt config name: refused here, before the data is read or a model loads
            try:
                stage = cl.zero.stage(self.deepspeed)
            except cl.zero.ZeroConfigError as e:
                raise ConfigError(f"--deepspeed {self.deepspeed}: {e}") from None
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise ConfigError(f"--precision must be auto, fp32, bf16 or fp16, got {self.precision!r}")
        if self.precision == "fp16" and self.deepspeed and not torch.cuda.is_available():
            raise ConfigError("--precision fp16 under DeepSpeed needs a CUDA GPU (DeepSpeed has no fp16 on CPU); "
                              "use --precision bf16 or fp32 here")
        if self.export_dtype not in ("bf16", "fp32"):
            raise ConfigError(f"--export-dtype must be bf16 or fp32, got {self.export_dtype!r}")
        speed.check(self)
        for name in ("steps", "micro_batch", "accum", "seq_len", "lora_r", "max_new_tokens", "log_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("clip", "weight_decay", "eval_n", "eval_every", "save_every", "keep_last", "warmup", "samples"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.lr is not None and not 0 < self.lr < math.inf:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if self.keep_best and not (self.save and self.eval_n):
            raise ConfigError("--keep-best compares the held-out loss of the checkpoints: it needs them (not --no-save) "
                              "and a held-out set (--eval-n > 0)")
        if self.eval_split is not None and not 0 < self.eval_split < 1:
            raise ConfigError(f"--eval-split must be a fraction between 0 and 1, got {self.eval_split}")
        if self.epochs is not None and not 0 < self.epochs < math.inf:
            raise ConfigError(f"--epochs must be > 0, got {self.epochs}")
        if self.steps is not None and (self.warmup or 0) > self.steps:
            raise ConfigError(f"--warmup {self.warmup} is longer than --steps {self.steps}")
        if not 0 <= self.warmup_ratio <= 1:
            raise ConfigError(f"--warmup-ratio is a fraction of the steps, from 0 to 1, got {self.warmup_ratio}")
        if self.attn not in ATTENTION:
            raise ConfigError(f"--attn must be {', '.join(ATTENTION[:-1])} or {ATTENTION[-1]}, got {self.attn!r}")
        if self.attn == "flash_attention_2" and not torch.cuda.is_available():
            raise ConfigError("--attn flash_attention_2 needs a CUDA GPU (the flash-attn kernels); on this machine use "
                              "--attn sdpa or eager")
        if self.attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            raise ConfigError("--attn flash_attention_2 needs the flash-attn package (pip install flash-attn); "
                              "or use --attn sdpa")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min-lr-ratio is a fraction of --lr, from 0 to 1, got {self.min_lr_ratio}")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_base_dtype not in ("auto", "fp32"):
            raise ConfigError(f"--lora-base-dtype must be auto or fp32, got {self.lora_base_dtype!r}")
        if not self.merge and not (self.lora or self.qlora):
            raise ConfigError("--no-merge is for --lora/--qlora (a full fine-tune exports its whole model)")
        if not all(self.lora_targets.split(",")):
            raise ConfigError(f"--lora-targets is a comma-separated list of module names, got {self.lora_targets!r}")
        if self.qlora and not torch.cuda.is_available():
            raise ConfigError("--qlora needs a CUDA GPU (bitsandbytes' 4-bit NF4 kernels); on this machine use --lora")
        if (self.lora or self.qlora) and (self.fsdp or stage == 3):  # stage 3 by name or in a .json of one's own
            raise ConfigError("LoRA trains ~1% of the weights: use it with one process, DDP or ZeRO-1/2, not --fsdp "
                              "or ZeRO-3")

    @classmethod
    def parser(cls):
        parser = super().parser()
        parser.error = one_line_error  # a bad flag or value: one `error:` line, not argparse's usage block
        parser.set_defaults(steps=None)  # (the dataclass fills in DEFAULT_STEPS only where --epochs is not given)
        parser.epilog = "sft.py export CHECKPOINT --out DIR: a checkpoint as a Hugging Face directory (export --help)"
        return parser

    def warmup_steps(self) -> int:
        """The warmup: --warmup, else --warmup-ratio of the steps, rounded down (0.1: a tenth, as before the ratio)."""
        return self.warmup if self.warmup is not None else int(self.warmup_ratio * self.steps)

    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else (2e-4 if self.lora or self.qlora else 2e-5)

    def base_dtype(self, computes: str) -> str:
        """The dtype the weights load in, given what the run computes in (bf16, fp16 or fp32): fp32 master weights,
        but under --lora a frozen base needs no master copy: the run's 16-bit dtype where it computes in one (unless
        --lora-base-dtype fp32). The adapters, their gradients and AdamW state are fp32 either way."""
        return computes if self.lora and computes != "fp32" and self.lora_base_dtype == "auto" else "fp32"


def one_line_error(message: str):
    raise SystemExit(f"error: {message} (--help lists the flags)")


class RunError(Exception):
    """What stops a run that started well (Ctrl-C, a full disk, divergence): its one line, as it is. `everywhere`: every
    rank stops on it, saying the same (a Ctrl-C reaches every process of the launch; the loss is all-reduced): rank 0
    alone says it."""

    def __init__(self, line: str, everywhere: bool = False):
        super().__init__(line)
        self.everywhere = everywhere


# Whether transformers takes a boolean mask for `logits_to_keep` (its `slice_logits_to_keep`); older versions index
# the sequence axis with it, which a (batch, seq) mask fails (IndexError).
MASK_KEEP = hasattr(importlib.import_module("transformers.modeling_utils"), "slice_logits_to_keep")


def sft_loss(model, batch: dict, loss_chunk: int = 0) -> torch.Tensor:
    """Mean cross-entropy over the assistant's tokens, with the LM head applied only where it is needed.

    `model(**batch).loss` projects every position onto the vocabulary, prompts included, then throws
    most of it away (label -100). Here the model returns logits only at the positions that predict a
    trained token (`logits_to_keep` with a boolean mask): the same loss, less compute, and for Qwen2.5's
    152k-word vocabulary far less logits memory. Called through the wrapper (DDP, FSDP2, DeepSpeed).
    `loss_chunk` > 0: the model computes it in its forward, never holding the logits (`speed.LossInForward`)."""
    if loss_chunk:
        return model(**batch, loss_chunk=loss_chunk).loss
    labels = batch["labels"]
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != D.IGNORE  # position p predicts token p + 1
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if MASK_KEEP:
        logits = model(**inputs, logits_to_keep=keep).logits  # (trained tokens, vocabulary)
    else:  # older transformers (5.17 among them): every position's logits, then the mask
        logits = model(**inputs).logits[keep]
    return F.cross_entropy(logits.float(), labels[:, 1:][keep[:, :-1]]) if keep.any() else logits.sum() * 0


# --- data ------------------------------------------------------------------------------------------
def load_data(cfg: Config, tokenizer, ctx=None) -> dict:
    """The training rows (token ids and labels), the held-out conversations and their tokenized rows, and what
    truncation did. Every check happens here, before anything is written (but the tokenized data's cache)."""
    train, held_out, split = read_split(cfg)

    def build() -> dict:
        parts = {"train": D.tokenize_chats(train, tokenizer, cfg.seq_len)}
        if held_out:
            parts["eval"] = D.tokenize_chats(held_out, tokenizer, cfg.seq_len)
        return parts

    ctx = ctx or cl.dist.Context(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    if cfg.data_cache == "off":
        parts = build()
    else:
        where = Path(cfg.data_cache) if cfg.data_cache else cl.paths.build_dir() / "cache" / "tokenized"
        path = where / f"{D.tokens_key([train, held_out], tokenizer, cfg.seq_len)}.pt"
        parts = tokenized_once(path, build, ctx)
    rows, stats = parts["train"]
    if cfg.pack:
        from datasets import Dataset

        rows = D.pack(Dataset.from_list(rows), cfg.seq_len).to_list()
    eval_rows = parts["eval"][0] if held_out else []
    real = [len(r["input_ids"]) - filler(r) for r in rows]  # each row's tokens, the packing's filler not counted
    return {"rows": rows, "stats": stats, "held_out": held_out, "eval_rows": eval_rows, "split": split,
            "real_tokens": real}


def tokenized_once(path: Path, build, ctx, store=None) -> dict:
    """The tokenized data: read from the cache file `path` where an earlier run wrote it (saying so in one line), else
    built (`build()`) by rank 0 alone, which writes it there; the other ranks wait for rank 0's word in the launch's
    store (no collective: a large dataset may take longer than --timeout), then read the file, or tokenize
    themselves where rank 0 could not write it or they cannot see it (another machine's disk). Where rank 0's build
    fails (a bad conversation), they build too and stop on the same error."""
    if store is None and ctx.world_size > 1:
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
    tag = f"sft/tokenized/{path.stem}"
    if ctx.rank == 0 or store is None:
        parts = D.load_tokens(path)
        if parts is not None:
            cl.dist.rprint(f"tokenized data read from the cache {path} (--data-cache off: tokenize again)", ctx=ctx)
        else:
            try:
                parts = build()
            except BaseException:
                if store is not None:
                    store.set(tag, "failed")
                raise
            if not D.save_tokens(path, parts):
                cl.dist.rprint(f"note: the tokenized data could not be cached in {path.parent} (not writable or "
                               f"full); every rank tokenizes it", ctx=ctx)
        if store is not None:
            store.set(tag, "ready")
        return parts
    import datetime

    store.wait([tag], datetime.timedelta(days=1))
    parts = D.load_tokens(path) if store.get(tag) == b"ready" else None
    return parts if parts is not None else build()


def read_split(cfg) -> tuple[list[dict], list[dict], int]:
    """(training conversations, held-out ones, how many were held out of the training data): the data files of
    `--data-dir` (D.data_files) read in any format, or a hub dataset's splits (D.read_hub); without an eval file or
    split, `hold_out` draws them."""
    fraction = getattr(cfg, "eval_split", None)
    if D.is_hub_name(cfg.data_dir):
        train, evaluation = D.read_hub(cfg.data_dir)
        eval_from = f"{cfg.data_dir}'s {evaluation[0]} split" if evaluation else None
        evaluation = evaluation[1] if evaluation else []
    else:
        train_files, eval_files = D.data_files(cfg.data_dir)
        eval_from = eval_files[0] if eval_files else None
    if fraction is not None and eval_from:
        raise D.ChatFormatError(f"--eval-split {fraction:g} holds out part of the training data, but {eval_from} "
                                f"is the held-out set: drop one")
    if not D.is_hub_name(cfg.data_dir):
        train = [c for f in train_files for c in D.read_data(f)]
        evaluation = [c for f in eval_files for c in D.read_data(f)] if eval_files and cfg.eval_n else []
    if cfg.eval_n and not eval_from:
        train, held_out = hold_out(train, cfg.eval_n, cfg.seed, fraction)
        return train, held_out[:cfg.eval_n], len(held_out)
    return train, evaluation[:cfg.eval_n] if cfg.eval_n else [], 0


def held_out_from(cfg, data: dict) -> str | None:
    """The file(s) the held-out conversations came from: the training data's (split off) or the eval file's."""
    if D.is_hub_name(cfg.data_dir):
        return (cfg.data_dir if data["split"] else f"{cfg.data_dir} (held-out split)") if data["held_out"] else None
    train_files, eval_files = D.data_files(cfg.data_dir)
    files = train_files if data["split"] else eval_files if data["held_out"] else []
    return ", ".join(f.name for f in files) or None


def training_names(cfg) -> str:
    """The training data's file names (or hub dataset name), for a line that names them."""
    return cfg.data_dir if D.is_hub_name(cfg.data_dir) else ", ".join(f.name for f in D.data_files(cfg.data_dir)[0])


def filler(row: dict) -> int:
    """The filler that ends a packed row (D.pack: one more "example", positions from 0, nothing trained); else 0."""
    if "position_ids" not in row:
        return 0
    last = len(row["position_ids"]) - 1 - row["position_ids"][::-1].index(0)  # where the last example starts
    return len(row["labels"]) - last if all(label == D.IGNORE for label in row["labels"][last:]) else 0


def check_vocabulary(cfg: Config, data: dict, tokenizer) -> None:
    """Every token id of the data is a row of the model's embedding (config.json's `vocab_size`), checked before the
    model loads: tokens added to a tokenizer without resizing the model (`resize_token_embeddings`) would otherwise
    end the first step in an IndexError."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(cfg.model_path, local_files_only=True).vocab_size
    largest = max((max(r["input_ids"]) for r in data["rows"] + data["eval_rows"] if r["input_ids"]), default=-1)
    if largest >= vocab:
        raise ConfigError(f"the data holds token id {largest:,} ({tokenizer.convert_ids_to_tokens(largest)!r}) but the "
                          f"model's vocabulary has {vocab:,} rows (config.json vocab_size; the tokenizer has "
                          f"{len(tokenizer):,} tokens): resize the model's embeddings to the tokenizer "
                          f"(model.resize_token_embeddings(len(tokenizer)), then save it) or use the model's tokenizer")


def hold_out(train: list[dict], eval_n: int, seed: int, fraction: float | None = None) -> tuple[list[dict], list[dict]]:
    """(the rest, the held-out): `eval_n` conversations of `train`, at most a tenth of them (at least one), drawn by
    `seed`, or with `fraction` (--eval-split) that fraction of them, rounded (at least one); both in file order. The draw is a function of the file, `eval_n` and the seed (a resumed run makes it
    again: the fingerprint's data part names the split)."""
    n = max(1, round(len(train) * fraction)) if fraction is not None else min(eval_n, max(1, len(train) // 10))
    if len(train) - n < 1:
        raise D.ChatFormatError(f"the training data holds {len(train)} conversation(s): too few to hold any out for the "
                                f"held-out loss; add an eval.jsonl beside it, or pass --eval-n 0")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:n])
    return [c for i, c in enumerate(train) if i not in held], [c for i, c in enumerate(train) if i in held]


def describe_split(cfg: Config, split: int, kept: int) -> str:
    names = training_names(cfg)
    where = f"no eval.jsonl in {cfg.data_dir}" if Path(cfg.data_dir).is_dir() else \
        f"no test or validation split in {cfg.data_dir}" if D.is_hub_name(cfg.data_dir) else cfg.data_dir
    how = f"--eval-split {cfg.eval_split:g}, " if cfg.eval_split is not None else ""
    return (f"{where}: {split} of {split + kept} conversations of {names} held out "
            f"({how}drawn by --seed {cfg.seed}) for the held-out loss and samples; training on the other {kept} "
            f"(--eval-n 0: no held-out evaluation)")


def resolve_steps(cfg: Config, n_rows: int, world_size: int) -> Config:
    """The config with `--epochs` turned into the optimizer steps that cover it: rows x epochs / global batch,
    rounded up (the data order then runs on through the epochs, D.step_indices). `--steps` runs: as they are."""
    if cfg.epochs is None:
        return cfg
    steps = max(1, math.ceil(cfg.epochs * n_rows / (cfg.micro_batch * cfg.accum * world_size)))
    return replace(cfg, steps=steps, epochs=None)


def write_json(path: Path, obj: dict) -> None:
    """`obj` as JSON at `path`, whole or not at all (a .tmp, then a rename: a crash leaves the old file). A number that
    is not finite (nan, inf) is written null: strict JSON readers refuse a bare NaN."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(finite(obj), indent=1, default=lambda x: finite(float(x)), allow_nan=False) + "\n")
    os.replace(tmp, path)


def finite(obj):
    """`obj` with every float that is not finite made None, in its dicts, lists and tuples."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def check_out_dir(cfg: Config) -> None:
    """--out-dir is a directory this process can write in (or can be made where its nearest existing parent is one):
    tried with a nameless file before anything loads, so a read-only or foreign place is one line, not a traceback
    after the model loaded."""
    import tempfile

    out_dir = Path(cfg.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out-dir {out_dir} is a file: it must be a directory (or not exist yet)")
    there = next(p for p in (out_dir.absolute(), *out_dir.absolute().parents) if p.exists())
    try:
        if not there.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        with tempfile.TemporaryFile(dir=there):
            pass
    except OSError as e:
        raise ConfigError(f"--out-dir {out_dir}: cannot write in {there} ({e.strerror or e}): choose a directory this "
                          f"user can write") from None


def lora_targets(cfg: Config) -> list[str]:
    """`--lora-targets` checked against the model's linear layers, read off its config (a model built on the meta
    device: no weights loaded). `all-linear`: every linear layer but the output head, as peft reads it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model_path, local_files_only=True))
    head = model.get_output_embeddings()
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and m is not head})
    if cfg.lora_targets == "all-linear":
        return linear
    unknown = [t for t in cfg.lora_targets.split(",") if t not in linear]
    if unknown:
        raise ConfigError(f"--lora-targets: {', '.join(unknown)} is not a linear layer of this model (its linear "
                          f"layers: {', '.join(linear)}; or all-linear)")
    return cfg.lora_targets.split(",")


# --- the run's record: what a checkpoint continues ------------------------------------------------
# The settings that change the data order or the schedule, and LoRA's (they change what a checkpoint holds): a
# checkpoint resumed under other values would not continue the run that wrote it.
RUN_SETTINGS = ("seed", "steps", "lr", "warmup", "min_lr_ratio", "seq_len", "pack", "lora", "qlora", "lora_r",
                "lora_targets")


def digest(path: Path, whole: bool = True) -> str:
    """A file's sha256: of all of it, or (`whole=False`, for weights of many GB) of its size, first and last MiB."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if whole:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            size = os.fstat(f.fileno()).st_size
            h.update(str(size).encode() + f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read())
    return h.hexdigest()[:16]


def model_digest(path) -> str:
    """A model directory's part of a run's fingerprint: its config, tokenizer (with the chat template, which
    transformers 5 saves apart, in chat_template.jinja) and weights."""
    model = Path(path)
    parts = [digest(model / name) for name in ("config.json", *cl.tokenizer.TOKENIZER_FILES)]
    parts += [f"{name} {digest(model / name)}" for name in cl.tokenizer.TEMPLATE_FILES if (model / name).is_file()]
    weights = sorted(model.glob("*.safetensors")) + sorted(model.glob("*.bin"))
    parts += [f"{f.name} {digest(f, whole=False)}" for f in weights]
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()[:16]


def fingerprint(cfg: Config, world_size: int, split: int = 0) -> dict:
    """What makes a run the one a checkpoint continues: the model (config, tokenizer, weights), the training data
    (with `split` conversations of it held out, there being no eval.jsonl: which ones), the global batch and
    RUN_SETTINGS; a warmup ratio other than the default. Saved in every checkpoint; `--resume` compares it."""
    files = [] if D.is_hub_name(cfg.data_dir) else D.data_files(cfg.data_dir)[0]
    data = digest(files[0]) if len(files) == 1 else \
        hashlib.sha256(" ".join(f"{f.name} {digest(f)}" for f in files).encode()).hexdigest()[:16] if files else \
        hashlib.sha256(f"hub {cfg.data_dir}".encode()).hexdigest()[:16]  # a hub dataset: by its name
    if split:
        data = hashlib.sha256(f"{data} less {split} held out".encode()).hexdigest()[:16]
    out = {"model": model_digest(cfg.model_path), "data": data,
           "global_batch": cfg.micro_batch * cfg.accum * world_size,
           **{name: getattr(cfg, name) for name in RUN_SETTINGS}}
    if cfg.warmup is None and cfg.warmup_ratio != WARMUP_RATIO:
        out["warmup_ratio"] = cfg.warmup_ratio
    return out


def differences(saved: dict | None, current: dict) -> list[str]:
    """How a checkpoint's fingerprint differs from this run's, in words (empty: the same run)."""
    if not saved:
        return ["it records no fingerprint of the run that wrote it"]
    named = {"model": "another model (--model-path)", "data": "other training data (train.jsonl)",
             "global_batch": "the global batch (--micro-batch x --accum x ranks)"}
    out = []
    optional = {"warmup_ratio": WARMUP_RATIO}  # in a fingerprint only where it is not the default
    for key in [*current, *(k for k in optional if k in saved and k not in current)]:
        there, here = saved.get(key, optional.get(key)), current.get(key, optional.get(key))
        if there != here:
            what = named.get(key, "--" + key.replace("_", "-"))
            out.append(what if key in ("model", "data") else f"{what} ({there} there, {here} here)")
    return out


def saved_fingerprint(path: Path) -> dict | None:
    """The fingerprint a checkpoint records; None when its record will not read (a truncated checkpoint.json)."""
    try:
        return cl.checkpoint.read_meta(path).get("fingerprint", {})
    except (OSError, ValueError):
        return None


def checkpoints_to_resume(cfg: Config, run: dict, ctx) -> list[Path]:
    """The checkpoints `--resume` may load, best first, checked before the model loads. `auto`: this run's in
    --out-dir, newest first, saying what it found (or that it found none). A checkpoint another run wrote
    (`differences`) stops the run with one line, unless `--allow-mismatch`."""
    if not cfg.resume:
        others = cl.checkpoint.complete(cfg.out_dir)
        if others:
            cl.dist.rprint(f"note: --out-dir holds {len(others)} checkpoint(s) of an earlier run (the newest "
                           f"{others[-1].name}); this run leaves them, but replaces one of the same step", ctx=ctx)
        return []
    if cfg.resume == "auto":
        found = cl.checkpoint.complete(cfg.out_dir)[::-1]
        saved = {p: saved_fingerprint(p) for p in found}  # each checkpoint's record, read once
        readable = [p for p in found if saved[p] is not None]
        for path in sorted(set(found) - set(readable)):
            cl.dist.rprint(f"warning: {path} will not load (its {cl.checkpoint.MARKER} does not read); skipped",
                           ctx=ctx)
        if not readable:
            cl.dist.rprint(f"--resume auto: no checkpoint in {cfg.out_dir}; starting at step 0", ctx=ctx)
            return []
        ours = [p for p in readable if not differences(saved[p], run)]
        candidates = ours if ours else readable
        cl.dist.rprint(f"--resume auto: found {candidates[0]}" + ("" if ours else " (written by another run)"), ctx=ctx)
    else:
        found = cl.checkpoint.resolve(cfg.resume)
        saved = {found: saved_fingerprint(found)} if found is not None else {}
        if saved.get(found) is None:
            raise ConfigError(f"--resume {cfg.resume}: no complete checkpoint there")
        candidates = [found]
    changed = differences(saved[candidates[0]], run)
    if changed and not cfg.allow_mismatch:
        raise ConfigError(f"{candidates[0]} was written by another run: {'; '.join(changed)}. Resume with that "
                          f"run's settings, start a new --out-dir, or pass --allow-mismatch")
    return candidates if cfg.allow_mismatch else [p for p in candidates if not differences(saved[p], run)]


def resume(backend, candidates: list[Path], ctx) -> dict:
    """Load the first of `candidates` that loads (a truncated shard falls back to the one before, saying so); return
    its metadata."""
    for i, path in enumerate(candidates):
        try:
            meta = backend.resume(path)
        except Exception as e:  # a truncated shard or metadata file: torch's own error, many lines
            reason = f"{path} will not load ({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]})"
            if i + 1 == len(candidates):
                raise ConfigError(reason + "; no earlier checkpoint of this run to fall back to") from None
            cl.dist.rprint(f"warning: {reason}; falling back to {candidates[i + 1]}", ctx=ctx)
            continue
        cl.dist.rprint(f"resumed from {path} at step {meta['step']}", ctx=ctx)
        return meta
    return {"step": 0}


@contextlib.contextmanager
def remembered_ctrl_c():
    """Inside: Ctrl-C (SIGINT) raises KeyboardInterrupt where it lands, as Python's own handler does, and is also
    remembered in the list this yields. Where Python cannot raise it (it lands in a finalizer or a callback, which
    prints "Exception ignored" and goes on), the training loop, which asks at every step, still stops. Main thread
    only: elsewhere (and with no handler of Python's installed) the list stays empty and nothing changes."""
    import signal
    import threading

    arrived = []
    before = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(before):
        yield arrived
        return

    def record(signum, frame):
        arrived.append(signum)
        before(signum, frame)

    signal.signal(signal.SIGINT, record)
    try:
        yield arrived
    finally:
        signal.signal(signal.SIGINT, before)


def save_checkpoint(backend, path: Path, meta: dict) -> None:
    """`backend.save`; a full disk ends the run with one line (the atomic save leaves the last good checkpoint)."""
    with disk_full_in_one_line(path, "the checkpoints before it are intact"):
        backend.save(path, meta)


def short_write(error: BaseException) -> bool:
    """Whether `error` says a write came up short: an ENOSPC (or quota) in its chain; torch's zip writer, which
    reports a full disk as "unexpected pos N vs M" with no errno; safetensors' "No space left on device"."""
    for c in chain(error):
        if getattr(c, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(c)
        if "unexpected pos" in text or "No space left on device" in text or "os error 28" in text:
            return True
    return False


@contextlib.contextmanager
def disk_full_in_one_line(path: Path, kept: str):
    """Inside: a write that fails for want of room ends the run with one line naming `path` and what is `kept`, and
    how much room is left there; a Ctrl-C that surfaced as the writer's own error stays a Ctrl-C."""
    try:
        yield
    except Exception as e:
        if any(isinstance(c, KeyboardInterrupt) for c in chain(e)):
            raise KeyboardInterrupt from None
        if not short_write(e):
            raise
        free = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free
        raise RunError(f"no space left writing {path.name} ({free / 1e6:,.1f} MB free there now; {kept})") from None


def save_due(since: float, ctx) -> bool:
    """The default checkpoint interval: whether SAVE_SECONDS have passed since `since` (the last checkpoint, or the
    start of training). Ranks decide together (any rank's clock past it: all save, as a save is collective): one
    scalar all-reduce a step, none alone."""
    due = float(time.perf_counter() - since >= SAVE_SECONDS)
    return cl.dist.all_reduce_scalar(due, "max") > 0 if ctx.world_size > 1 else bool(due)


def diverged(step: int, loss: float, grad_norm: float, backend, out_dir: Path | None) -> None:
    """Stop the run, with one line, at the first step whose loss or gradient norm is not finite (a too high --lr):
    nothing after it is saved or exported, so the last checkpoint is the last good one. The loss and the global norm
    are the same number on every rank, so every rank stops here. The norm is checked too: a nan gradient makes the
    weights nan in this step's update (AdamW's update is otherwise at most about lr per weight, never inf), and the
    loss shows it only a step later, after a checkpoint of this step would have been written. Under fp16 a non-finite
    norm is the loss scale's overflow, whose step was skipped: only the loss counts there."""
    bad = [f"the loss is {loss}"] if not math.isfinite(loss) else []
    if not math.isfinite(grad_norm) and backend.precision != "fp16":
        bad.append(f"the gradient norm is {grad_norm}")
    if not bad:
        return
    last = cl.checkpoint.latest(out_dir) if out_dir is not None else None
    raise RunError(f"step {step}: {' and '.join(bad)}: the run diverged (--lr {backend.cfg.peak_lr():g} too high?) and "
                   f"stopped, this step neither saved nor exported; "
                   + (f"the last checkpoint, {last.name}, is from before it" if last else "no checkpoint was written"),
                   everywhere=True)


def chain(error: BaseException | None) -> list[BaseException]:
    """`error` and the exceptions it came from."""
    out = []
    while error is not None and error not in out:
        out.append(error)
        error = error.__cause__ or error.__context__
    return out


# --- evaluation ------------------------------------------------------------------------------------
def generate_samples(backend, tokenizer, held_out: list[dict]) -> tuple[float, list]:
    """Held-out exact match of greedy generations and the (question, reference, answer) triples (`backend.generation`):
    on the first `--samples` held-out conversations (default: all), at most `--max-new-tokens` tokens each."""
    cfg = backend.cfg
    held_out = held_out if cfg.samples is None else held_out[:cfg.samples]
    if not held_out:
        return float("nan"), []
    with backend.generation(cfg.gather_generate) as kwargs, speed.eager():  # compiled layers: eager
        return cl.evaluation.exact_match(backend.module, tokenizer, held_out, max_new_tokens=cfg.max_new_tokens,
                                         **kwargs)


# --- the run ---------------------------------------------------------------------------------------
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def return_freed_memory(threshold: int = 1 << 20) -> bool:
    """On CPU ranks: every freed block of `threshold` bytes or more goes back to the operating system at once.

    glibc raises its mmap threshold as large blocks are freed (up to 32 MiB), so the 1-16 MiB shards, gathered
    layers and gradients a sharded rank frees every step stay in its heap, and the rank's resident memory grows
    with them. The recipe sets the threshold itself (mallopt), as `MALLOC_MMAP_THRESHOLD_` would, so a run started
    by hand gets what the course measures. Left alone where that variable is set, or where the C library is not
    glibc. Returns whether it was set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def huge_pages_for_tensors() -> bool:
    """PyTorch's CPU allocator asks the kernel for transparent huge pages (2 MiB) for every tensor of 2 MiB or more
    (its `THP_MEM_ALLOC_ENABLE`). With freed blocks going back to the system (`return_freed_memory`), every gathered
    layer, gradient and activation of a step is fresh memory the kernel maps and zeroes page by page; in 2 MiB pages
    that is 512 times fewer page faults, and a sharded CPU rank's step spends far less of its time in the kernel.
    PyTorch reads the variable once, at its first allocation: the recipe sets it before it makes any tensor, makes
    one, and takes the variable away again (the processes a run starts decide for themselves). Left alone where the
    variable is set (THP_MEM_ALLOC_ENABLE=0 turns it off). Returns whether huge pages were asked for (a tensor made
    before the call would have fixed PyTorch's choice already)."""
    if "THP_MEM_ALLOC_ENABLE" in os.environ:
        return os.environ["THP_MEM_ALLOC_ENABLE"] not in ("", "0")
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    try:
        torch.empty(1)  # PyTorch's allocator reads the variable now
    finally:
        del os.environ["THP_MEM_ALLOC_ENABLE"]
    return True


def train(cfg: Config, backend_factory=backends.make) -> dict:
    """Run the fine-tune described by `cfg`; return the results dict (on every rank). `backend_factory(cfg, ctx)`
    makes the backend (default: `backends.make`, which picks one from the config; chapter 11 passes its own)."""
    import torch.distributed as dist

    alone = bool(cfg.deepspeed) and "LOCAL_RANK" not in os.environ
    if alone:  # DeepSpeed asks for what a launcher sets, even in a process of its own (this run's, then unset)
        os.environ["LOCAL_RANK"] = "0"
    group_of_one = alone and not dist.is_initialized()
    try:
        return _train(cfg, backend_factory)
    finally:
        if alone:
            os.environ.pop("LOCAL_RANK", None)
        if group_of_one and dist.is_initialized():  # the group this run made for DeepSpeed, however it ended
            dist.destroy_process_group()


def _train(cfg: Config, backend_factory) -> dict:
    huge_pages_for_tensors()
    if cfg.save_every or cfg.resume:  # checkpoints to resume from: a resumed run repeats this one bit for bit on a GPU too
        cl.env.deterministic()  # before CUDA starts (cl.dist.init)
    started = time.perf_counter()
    transformers.utils.logging.disable_progress_bar()  # loading and writing weights: the recipe's own bar is enough
    ctx = cl.dist.init(timeout_s=cfg.timeout, group_of_one=bool(cfg.deepspeed))  # DeepSpeed needs a group, even of one
    if ctx.device.type == "cpu":
        return_freed_memory()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cl.seed_everything(cfg.seed)
    out_dir = Path(cfg.out_dir)
    check_out_dir(cfg)
    tokenizer = cl.model_dir.load_tokenizer(cfg.model_path)  # checks the directory first
    targets = lora_targets(cfg) if cfg.lora or cfg.qlora else []
    if cfg.memory_budget:  # the calculator's verdict, before anything loads
        from transformers import AutoConfig

        plan = backends.recipe_plan(AutoConfig.from_pretrained(cfg.model_path, local_files_only=True), cfg,
                                    ctx.world_size, cl.native_bf16(ctx.device))
        cl.memory.check_budget(plan, cfg.memory_budget * cl.memory.GB, f"{plan['backend']} on {ctx.world_size} rank(s)")
    data = load_data(cfg, tokenizer, ctx)
    rows = data["rows"]
    if data["split"]:
        cl.dist.rprint(describe_split(cfg, data["split"], data["stats"]["examples"]), ctx=ctx)
    cl.dist.rprint(D.describe_truncation(data["stats"], cfg.seq_len), ctx=ctx)
    asked = cfg
    cfg = resolve_steps(cfg, len(rows), ctx.world_size)  # --epochs: the steps that cover them
    per_rank, global_batch = cfg.micro_batch * cfg.accum, cfg.micro_batch * cfg.accum * ctx.world_size
    epochs = cfg.steps * global_batch / len(rows)  # what the steps cover, either flag
    cl.dist.rprint(f"training {cfg.steps:,} step{'s' if cfg.steps > 1 else ''} = {epochs:.2f} epochs of {len(rows):,} "
                   f"rows (global batch {global_batch} = --micro-batch {cfg.micro_batch} x --accum {cfg.accum} x "
                   f"{ctx.world_size} rank{'s' if ctx.world_size > 1 else ''}); warmup {cfg.warmup_steps()} steps, "
                   f"peak lr {cfg.peak_lr():g}" + (f" (from --epochs {asked.epochs:g})" if asked.epochs is not None
                                                   else ""), ctx=ctx)
    if data["stats"]["empty_answers"]:
        cl.dist.rprint(f"warning: empty assistant turns in {training_names(cfg)}: {data['stats']['empty_answers']:,} (only their "
                       f"end-of-turn token is trained: the model learns to answer with nothing)", ctx=ctx)
    if global_batch > len(rows):
        cl.dist.rprint(f"warning: the global batch ({global_batch}) is larger than the training data ({len(rows):,} "
                       f"rows): every batch holds some rows more than once (lower --micro-batch or --accum)", ctx=ctx)
    check_vocabulary(cfg, data, tokenizer)
    run = fingerprint(cfg, ctx.world_size, data["split"])
    candidates = checkpoints_to_resume(cfg, run, ctx)

    # the backend's schedule reads --warmup: the steps --warmup-ratio makes (the config the run records keeps the flags)
    backend = backend_factory(replace(cfg, warmup=cfg.warmup_steps()), ctx)
    model = backend.load_model(cfg.model_path)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3: the unpartitioned size
    if cfg.act_ckpt:
        cl.models.checkpoint_layers(model)
    if cfg.lora or cfg.qlora:
        torch.manual_seed(cfg.seed)
        model = cl.models.add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, targets)
    backend.setup(speed.apply(model, cfg))  # loss in forward, compiled layers: before the backend wraps it
    phases = cl.measure.RunPhases(started)  # each phase's high-water resident memory, seconds since the start
    phases.done("loaded")

    start, log = 0, {k: [] for k in ("step", "loss", "lr", "grad_norm", "seconds", "cpu_seconds", "tokens",
                                     "batch_tokens", "targets")}
    resumed = resume(backend, candidates, ctx) if candidates else {}
    start = resumed.get("step", 0)
    run_id = resumed.get("run") or uuid.uuid4().hex[:12]  # a resumed run goes on under the id of the one it continues

    result = {"backend": backend.name, "world_size": ctx.world_size, "precision": backend.precision,
              "start_step": start, "params": n_params, "lr_peak": cfg.peak_lr(), "data": data["stats"],
              "trainable": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad),
              "eval": [], "steps": cfg.steps, "epochs": epochs, "train_rows": len(rows),
              "held_out_from": held_out_from(cfg, data)}
    bar = None

    def say(line: str) -> None:  # rank 0's log lines, through the progress bar where there is one (no torn bar)
        if not ctx.is_main:
            return
        with bar.external_write_mode() if bar is not None else contextlib.nullcontext():  # clears, then redraws it
            print(line, flush=True)

    @speed.eager()  # compiled layers: no recompilation for a no-grad forward
    def evaluate(step: int) -> None:
        loss_fn = functools.partial(sft_loss, loss_chunk=cfg.loss_chunk)
        loss = cl.evaluation.held_out_loss(backend.model, data["eval_rows"], loss_fn, cfg.micro_batch, tokenizer.pad_token_id,
                                           ctx, autocast=backend.autocast, padding_free=cfg.padding_free)
        result["eval"].append({"step": step, "loss": loss, "perplexity": math.exp(min(loss, 50))})
        if data["eval_rows"]:  # (--eval-n 0: nothing was scored)
            say(f"eval step {step}: loss {loss:.4f}, perplexity {result['eval'][-1]['perplexity']:.3f}")
        if monitor:
            monitor.log(step, eval_loss=loss)

    # a resumed run appends to the event files of the steps before it; what the interrupted run logged after the
    # checkpoint it resumes from (steps start + 1 on, which this run logs again) TensorBoard then leaves out
    monitor = cl.train.Monitor("sft", log_dir=out_dir / "tensorboard", overwrite=start == 0,
                               purge_step=start + 1 if start else None) if ctx.is_main else None
    if ctx.is_main:  # the run's settings as resolved, beside its checkpoints (a resumed run writes them again)
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(out_dir / "config.json", {
            "config": asdict(cfg), "steps": cfg.steps, "epochs": epochs, "epochs_asked": asked.epochs,
            "warmup_steps": cfg.warmup_steps(), "global_batch": global_batch, "train_rows": len(rows),
            "held_out": {"from": result["held_out_from"], "conversations": len(data["held_out"])},
            "world_size": ctx.world_size, "backend": backend.name, "precision": backend.precision,
            "device": ctx.device.type, "start_step": start, "run": run_id, "fingerprint": run})
    if cfg.eval_before:
        result["exact_match_before"], _ = generate_samples(backend, tokenizer, data["held_out"])
        evaluate(start)
    stop = min(cfg.steps, cfg.halt_after or cfg.steps)
    if ctx.is_main and cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=stop, initial=start, desc=f"sft {backend.name} x{ctx.world_size}",
                   mininterval=0.1 if sys.stderr.isatty() else 10)  # piped (a launch): a line every 10 s
    def make_batches(step: int) -> list[dict]:  # this rank's micro-batches of `step`, on its device
        mine = D.step_indices(step, len(rows), global_batch, cfg.seed)[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]
        micro = [D.collate([rows[i] for i in mine[k * cfg.micro_batch:(k + 1) * cfg.micro_batch]],
                           tokenizer.pad_token_id, cfg.padding_free) for k in range(cfg.accum)]
        return [{k: v.to(ctx.device, non_blocking=True) for k, v in mb.items()} for mb in micro]

    def log_line(step: int, since: int) -> str:
        """Step `step`'s line: the step's loss, lr and gradient norm; real tokens (no padding, no packing filler) a
        second over the steps since the last line (their own time: not evaluation's, not checkpoints'); the
        high-water memory so far. The global batch's rows are the same on every rank: counted here, no collective."""
        real = sum(data["real_tokens"][i] for s in range(start + since, step)
                   for i in D.step_indices(s, len(rows), global_batch, cfg.seed))
        tokens_per_s = real / max(1e-9, sum(log["seconds"][since:]))
        memory = (f"peak CUDA {cl.cuda_peak_bytes() / 1e6:,.0f} MB" if ctx.device.type == "cuda"
                  else f"peak RSS {phases.peak() / 1e6:,.0f} MB")
        return (f"step {step}/{cfg.steps} | epoch {step * global_batch / len(rows):.2f} | loss {log['loss'][-1]:.4f} | "
                f"lr {log['lr'][-1]:.3e} | grad norm {log['grad_norm'][-1]:.3f} | {tokens_per_s:,.0f} tokens/s | "
                f"{memory}")

    backend.model.train()
    last_save = time.perf_counter()  # the default --save-every counts the training time since this
    step, logged, finished = start, 0, start  # `logged`: the steps of `log` the last line covered; `finished`: done
    try:
        with remembered_ctrl_c() as ctrl_c, \
                speed.Prefetcher(make_batches, range(start, stop), ahead=cfg.prefetch) as batches:  # its thread ends here
            for step in range(start, stop):
                if ctrl_c:  # a Ctrl-C whose KeyboardInterrupt was swallowed where it landed
                    raise KeyboardInterrupt
                t0, c0 = time.perf_counter(), time.process_time()  # wall, and this process's CPU time
                # the step's random draws (LoRA's dropout) are a function of the step too, as its batches are: a
                # resumed run draws what the uninterrupted one drew
                torch.manual_seed(cfg.seed * 100_003 + step)
                micro = next(batches)
                counts = [cl.train.count_targets(mb) for mb in micro]
                total = cl.dist.all_reduce_scalar(sum(counts))  # target tokens of the whole global batch
                if total == 0:
                    raise RuntimeError(f"step {step + 1}: the batch has no target tokens: nothing to train on")
                loss_sum = 0.0
                # the lr this step applies, read before any backward: DeepSpeed's backward steps the engine, and with
                # it the schedule, at the last micro-batch
                lr = backend.lr()
                trace = cfg.memory_trace and step == stop - 1
                tracer = cl.live_memory.LiveTensorBytes(backend.model, backend.optimizer if backend.name != "deepspeed" else None,
                                                        logits_module=backend.module.get_output_embeddings()) \
                    if trace else contextlib.nullcontext()
                with phases.apart("traced step", when=trace), tracer:  # the tracer's own copies: not the run's peak
                    for k, (mb, n) in enumerate(zip(micro, counts)):
                        with backend.sync(last=k == cfg.accum - 1):
                            with backend.autocast():
                                loss = sft_loss(backend.model, mb, cfg.loss_chunk)
                            # ranks average gradients: x world_size / total makes it the mean over all target tokens
                            backend.backward(loss * (n * ctx.world_size / total))
                        loss_sum += float(loss.detach()) * n
                    if trace:
                        tracer.mark("step")
                    grad_norm = backend.step()
                if trace:
                    result["memory"] = cl.dist.gather(backends.measured_vs_predicted(
                        tracer, backend, model.config, micro, checkpointing=cfg.act_ckpt,
                        **backends.recipe_lora(cfg, backend.precision)), ctx)
                loss_value = cl.dist.all_reduce_scalar(loss_sum) / total
                diverged(step + 1, loss_value, grad_norm, backend, out_dir if cfg.save else None)
                tokens = cl.dist.all_reduce_scalar(sum(int(mb["attention_mask"].sum()) if "attention_mask" in mb
                                                       else mb["input_ids"].numel() for mb in micro))  # padding not counted
                seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
                batch_tokens = sum(mb["input_ids"].numel() for mb in micro) * ctx.world_size  # padding included
                for key, value in zip(log, (step + 1, loss_value, lr, grad_norm, seconds, cpu_seconds, tokens, batch_tokens,
                                            total)):
                    log[key].append(value)
                finished = step + 1  # (a Ctrl-C from here on, in its log line or its checkpoint, comes after this step)
                if monitor and (step + 1) % cfg.log_every == 0:
                    monitor.log(step + 1, loss=loss_value, lr=lr, grad_norm=grad_norm)
                if ctx.is_main and ((step + 1) % cfg.log_every == 0 or step + 1 == stop):
                    say(log_line(step + 1, logged))
                    logged = len(log["step"])
                if bar:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss_value:.4f}", refresh=False)
                periodic = (step + 1) % cfg.save_every == 0 if cfg.save_every else \
                    cfg.save and cfg.save_every is None and step + 1 < stop and save_due(last_save, ctx)
                saving = cfg.save and (periodic or step + 1 == stop)
                if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < stop or saving and cfg.keep_best:
                    evaluate(step + 1)
                if saving:
                    scored = result["eval"][-1]["loss"] if result["eval"] and result["eval"][-1]["step"] == step + 1 \
                        and data["eval_rows"] else None
                    save_checkpoint(backend, out_dir / f"checkpoint-{step + 1:06d}",
                                    {"step": step + 1, "loss": loss_value, "eval_loss": finite(scored), "run": run_id,
                                     "fingerprint": run, "config": asdict(cfg), "precision": backend.precision})
                    if ctx.is_main:  # this run's: never another's
                        cl.checkpoint.keep_newest(out_dir, cfg.keep_last, run=run_id, keep_best=cfg.keep_best)
                    last_save = time.perf_counter()
    except KeyboardInterrupt:  # Ctrl-C: one line (the atomic save left the last checkpoint whole)
        last = cl.checkpoint.latest(out_dir) if cfg.save else None
        raise RunError(f"interrupted at step {finished}; --resume auto continues"
                       + (f" from {last.name}" if last else " (no checkpoint yet: --save-every N writes them; by default "
                                            f"the first comes after {SAVE_SECONDS / 60:g} minutes of training)"),
                       everywhere=True) from None
    if bar:
        bar.close()
        bar = None
    phases.done("trained")

    timed = slice(1, None) if len(log["seconds"]) > 1 else slice(None)  # step 1 warms up allocators and caches
    result.update(log, tokens_per_s=sum(log["tokens"][timed]) / max(1e-9, sum(log["seconds"][timed])),
                  halted=stop < cfg.steps)
    if stop == cfg.steps:
        # the export first: generation gathers the whole model on every rank (sharded, `--gather-generate`), which a
        # large model may not survive; the trained model is on disk before that is tried
        if cfg.export:
            last = cl.checkpoint.latest(out_dir) if cfg.save else None
            with disk_full_in_one_line(out_dir / "final", f"the last checkpoint, {last.name}, is intact: `sft.py "
                                                          f"export` writes it once there is room" if last else
                                                          "--no-save: the trained weights were not written"):
                backend.export(out_dir / "final", tokenizer)
            result["final_dir"] = str(out_dir / "final")
            phases.done("exported")
        if not (result["eval"] and result["eval"][-1]["step"] == stop):  # (--keep-best scored the last checkpoint)
            evaluate(stop)
        if cfg.keep_best:
            best = cl.checkpoint.best(out_dir, run=run_id)
            if best is not None:
                result["best_checkpoint"] = {"path": str(best), **{k: cl.checkpoint.read_meta(best)[k]
                                                                   for k in ("step", "eval_loss")}}
                cl.dist.rprint(f"best checkpoint: {best} (held-out loss {result['best_checkpoint']['eval_loss']:.4f} "
                               f"at step {result['best_checkpoint']['step']})", ctx=ctx)
        result["exact_match_after"], samples = generate_samples(backend, tokenizer, data["held_out"])
        phases.done("evaluated")
        result["samples"] = samples[:8]
        if ctx.is_main and samples:
            cl.evaluation.write_samples(out_dir / "samples.jsonl", stop, samples)
            for question, reference, answer in samples[:3]:
                cl.dist.rprint(f"sample: {question[:60]!r} -> {answer[:60]!r} (reference {reference[:60]!r})", ctx=ctx)
    if monitor:
        monitor.close()
    result["peak_rss_per_rank"] = cl.dist.gather(phases.peak(), ctx)  # each process's high-water mark
    result["cuda_peak_per_rank"] = cl.dist.gather(cl.cuda_peak_bytes(), ctx)
    result["rss_phases_per_rank"] = cl.dist.gather(phases.rss, ctx)
    result["phase_seconds"] = phases.seconds  # rank 0's: where a run's time goes (load, train, evaluate, export)
    result["run_seconds"] = time.perf_counter() - started  # start to end ("seconds": each step's)
    if ctx.is_main:
        write_json(out_dir / "metrics.json", metrics(result, log))
    backend.close()
    return result


def metrics(result: dict, log: dict) -> dict:
    """metrics.json: a run's figures (the result dict less its per-step lists and samples); what was not measured
    (no held-out conversations, no samples) is null, not NaN (which strict JSON readers refuse)."""
    evals = [e for e in result["eval"] if not math.isnan(e["loss"])]
    return finite({"steps": result["steps"], "start_step": result["start_step"], "last_step": log["step"][-1] if log["step"]
            else result["start_step"], "halted": result["halted"], "epochs": result["epochs"],
            "train_rows": result["train_rows"], "final_loss": log["loss"][-1] if log["loss"] else None,
            "eval": evals, "held_out_loss": evals[-1]["loss"] if evals else None,
            "exact_match_after": result.get("exact_match_after"),
            "exact_match_before": result.get("exact_match_before"),
            "tokens_per_s": result["tokens_per_s"], "peak_rss_per_rank": result["peak_rss_per_rank"],
            "cuda_peak_per_rank": result["cuda_peak_per_rank"], "seconds": result["run_seconds"],
            "phase_seconds": result["phase_seconds"], "backend": result["backend"], "world_size": result["world_size"],
            "precision": result["precision"], "params": result["params"], "trainable": result["trainable"]})


# --- `sft.py export`: a checkpoint as the directory its run would have exported --------------------------------
def export_parser():
    import argparse

    parser = argparse.ArgumentParser(
        prog="sft.py export", allow_abbrev=False,
        description="Export a checkpoint of this recipe as a Hugging Face directory: what the run's own final export "
                    "writes, had the run ended at that checkpoint. One process, on the CPU; the model, the LoRA "
                    "settings and the export's are the run's, as the checkpoint records them.")
    parser.add_argument("checkpoint", help="a checkpoint directory of a run (e.g. runs/sft/checkpoint-000200)")
    parser.add_argument("--out", required=True, help="the directory to write: new, empty, or an earlier export of "
                                                     "this checkpoint (then replaced)")
    parser.add_argument("--model-path", help="the run's model where it is now (default: where the run read it)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), help="the exported weights' dtype (default: the run's "
                                                                   "--export-dtype)")
    parser.add_argument("--merge", action=argparse.BooleanOptionalAction, default=None,
                        help="LoRA: the merged model beside adapter/ (--no-merge: the adapter only); default: as the run")
    parser.error = one_line_error
    return parser


def export_config(checkpoint: Path, model_path: str | None = None, dtype: str | None = None,
                  merge: bool | None = None) -> tuple[Config, dict, Path]:
    """The config of the run that wrote `checkpoint`, as the checkpoint records it, with the export's overrides; the
    checkpoint's record; and the checkpoint itself (`resolve`: `.prev` where a crashed save left only that). The
    precision is the one the run computed in (what `auto` resolved to on its machine): it decides the dtype a LoRA
    base and DeepSpeed's weights were held in."""
    found = cl.checkpoint.resolve(checkpoint)
    if found is None:
        newest = cl.checkpoint.latest(checkpoint) if checkpoint.is_dir() else None
        raise ConfigError(f"{checkpoint} is not a checkpoint (no {cl.checkpoint.MARKER})"
                          + (f": it holds checkpoints, the newest {newest}" if newest else ""))
    try:
        meta = cl.checkpoint.read_meta(found)
    except ValueError as e:
        raise ConfigError(f"{found / cl.checkpoint.MARKER} does not read ({e})") from None
    recorded = meta.get("config")
    if not isinstance(recorded, dict):
        raise ConfigError(f"{checkpoint} records no run config: not a checkpoint of this recipe"
                          + (" (an export: it holds the model already)" if "from" in meta else ""))
    known = {f.name for f in fields(Config)}
    settings = {k: v for k, v in recorded.items() if k in known}
    settings["precision"] = meta.get("precision", settings.get("precision", "auto"))
    if settings.get("qlora"):  # QLoRA exports the merge into the base read again in bf16, never the 4-bit base
        settings.update(qlora=False, lora=True, lora_base_dtype="auto", precision="bf16")
    if merge is False and not settings.get("lora"):
        raise ConfigError("--no-merge is for a LoRA run's checkpoint (a full fine-tune exports its whole model)")
    overrides = {"model_path": model_path, "export_dtype": dtype, "merge": merge if settings.get("lora") else None}
    settings.update({k: v for k, v in overrides.items() if v is not None})
    return Config(**settings), meta, found


def check_export_model(cfg: Config, meta: dict, moved: bool) -> None:
    """The model to export onto is there and is the one the run trained (the fingerprint its checkpoint records)."""
    try:
        cl.model_dir.check_model_dir(cfg.model_path)
    except FileNotFoundError as e:
        raise ConfigError(f"{e}" + ("" if moved else "; the run read its model there: if it moved, pass --model-path "
                                                     "where it is now")) from None
    saved = (meta.get("fingerprint") or {}).get("model")
    if saved and saved != model_digest(cfg.model_path):
        raise ConfigError(f"{cfg.model_path} is not the model the run trained (its config, tokenizer or weights differ "
                          f"from the checkpoint's record): pass --model-path the run's model")


def check_export_out(out: Path, checkpoint: Path) -> None:
    """`--out` is new, empty, or an earlier export of this checkpoint (which the export replaces, atomically)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: it must be a directory (or not exist yet)")
    if out.is_dir() and any(out.iterdir()) and exported_from(out) != str(checkpoint.resolve()):
        raise ConfigError(f"--out {out} is not empty and is no export of {checkpoint}: choose a new directory")


def exported_from(directory: Path) -> str | None:
    """The checkpoint a `sft.py export` directory holds, as its record names it; None for anything else."""
    try:
        return cl.checkpoint.read_meta(directory).get("checkpoint")
    except (OSError, ValueError, AttributeError):
        return None


def deepspeed_weights(found: Path) -> dict:
    """A DeepSpeed checkpoint's model weights. ZeRO-0/1/2 hold the whole model on every rank and DeepSpeed saves rank
    0's as the engine held it (`mp_rank_00_model_states.pt`; with LoRA the adapters alone); ZeRO-3 saves partitions,
    which DeepSpeed's zero_to_fp32 puts together into the fp32 master weights."""
    whole = found / "state" / "mp_rank_00_model_states.pt"
    if whole.is_file():
        return torch.load(whole, map_location="cpu", weights_only=False)["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):  # it prints each step of the assembly
        return get_fp32_state_dict_from_zero_checkpoint(str(found), tag="state")


def load_checkpoint_weights(model, found: Path, deepspeed: bool) -> None:
    """The checkpoint's weights into `model`, the run's model built on one process. A DCP checkpoint loads whatever
    ranks and sharding wrote it; DeepSpeed's state dict must hold every weight the run trained."""
    if not deepspeed:
        cl.checkpoint.load_sharded(found, model)
        return
    missing, unexpected = model.load_state_dict(deepspeed_weights(found), strict=False)
    not_trained = {n for n, p in model.named_parameters() if not p.requires_grad} | cl.checkpoint.aliases(model)
    absent = sorted(set(missing) - not_trained)
    if absent or unexpected:
        raise ValueError(f"its weights are not the model's ({len(absent)} missing, e.g. {absent[:2]}; "
                         f"{len(unexpected)} unexpected, e.g. {unexpected[:2]})")


class CheckpointExport(backends.Single):
    """One process holding a checkpoint's weights: the recipe's own export, its record naming the checkpoint."""

    def __init__(self, cfg, ctx, source: dict):
        super().__init__(cfg, ctx)
        self.source = source

    def export_meta(self) -> dict:
        return {**super().export_meta(), **self.source}


def export_checkpoint(checkpoint, out, model_path: str | None = None, dtype: str | None = None,
                      merge: bool | None = None) -> dict:
    """Export `checkpoint` into `out` through the recipe's own export (`backend.export`): the directory the run's final
    export writes, had the run ended at that step. The run's model is built as its backend built it: the base in the
    dtype the run held it in (a LoRA base: bf16 where the run computed in bf16), the adapters on the run's targets,
    under DeepSpeed in bf16 the weights in bf16 (its engine computes with, and the run exports, bf16 copies of the
    fp32 master weights); the checkpoint's weights are loaded into it; it is exported. Returns what was done."""
    checkpoint, out = Path(checkpoint), Path(out)
    cfg, meta, found = export_config(checkpoint, model_path, dtype, merge)
    check_export_model(cfg, meta, moved=model_path is not None)
    check_export_out(out, checkpoint)
    transformers.utils.logging.disable_progress_bar()
    ctx = cl.dist.Context(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    backend = CheckpointExport(cfg, ctx, {"checkpoint": str(checkpoint.resolve()), "step": meta.get("step")})
    tokenizer = cl.model_dir.load_tokenizer(cfg.model_path)
    model = backend.load_model(cfg.model_path)
    if cfg.lora:
        model = cl.models.add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, lora_targets(cfg))
    if cfg.deepspeed and backend.precision != "fp32":
        model.to(backends.DTYPES[backend.precision])  # as DeepSpeed's engine casts it
    try:
        load_checkpoint_weights(model, found, bool(cfg.deepspeed))
    except Exception as e:  # a truncated shard, another model's weights: the library's own error, many lines or none
        first = next(iter(str(e).strip().splitlines()), "")[:300]
        raise ConfigError(f"{found} will not load onto {cfg.model_path} "
                          f"({type(e).__name__}{': ' + first if first else ''})") from None
    backend.module = model
    backend.export(out, tokenizer)
    what = ("the merged model and adapter/" if cfg.merge else "the adapter") if cfg.lora else "the model"
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"read {checkpoint} (step {meta.get('step')}, {'DeepSpeed' if cfg.deepspeed else 'DCP'}"
          f"{', LoRA' if cfg.lora else ''}, model {cfg.model_path}); wrote {out}: {what} in {cfg.export_dtype}, "
          f"{size / 1e6:,.1f} MB", flush=True)
    return {"checkpoint": str(found), "step": meta.get("step"), "out": str(out), "lora": cfg.lora, "merged": cfg.merge,
            "dtype": cfg.export_dtype}


def export_main(argv: list[str]) -> dict:
    args = export_parser().parse_args(argv)
    os.environ.update(cl.env.quiet_env())  # DeepSpeed, if a library imports it, is told there is no GPU to look for
    try:
        return export_checkpoint(args.checkpoint, args.out, args.model_path, args.dtype, args.merge)
    except (ConfigError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None  # bad input: one line, nothing written
    except KeyboardInterrupt:  # the atomic write leaves --out as it was
        raise SystemExit(f"interrupted: {args.out} left as it was") from None


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    cfg = Config.parse(argv)
    cl.env.deepspeed_told_no_gpu()
    try:
        result = train(cfg)
    except (D.ChatFormatError, FileNotFoundError, ConfigError, cl.zero.ZeroConfigError,
            cl.memory.MemoryBudgetError) as e:
        raise SystemExit(f"error: {e}") from None  # bad input: one line, no traceback
    except RunError as e:
        if e.everywhere and int(os.environ.get("RANK", "0")) != 0:  # rank 0 says it; its exit ends the launch, and
            time.sleep(5)  # this rank leaving first must not have the launcher end rank 0 before it has said it
            raise SystemExit(1) from None
        raise SystemExit(str(e)) from None
    except KeyboardInterrupt:  # before training began: nothing written yet
        raise SystemExit("interrupted before training began") from None
    summary = {k: result[k] for k in ("backend", "world_size", "tokens_per_s", "exact_match_after") if k in result}
    summary["held_out_loss"] = result["eval"][-1]["loss"] if result["eval"] else None
    cl.dist.rprint(json.dumps(finite(summary), default=float))
    cl.dist.finish(result)
    return result


if __name__ == "__main__":
    main()
    cl.dist.exit_now()  # (skips the interpreter's teardown: see exit_now)
