"""Supervised fine-tuning (SFT) of a Qwen2.5 checkpoint: chapter 10's recipe, runnable on a cluster as it is.

    python sft.py --model-path Qwen2.5-0.5B --data-dir data/ --out-dir runs/sft          # one process
    torchrun --nproc-per-node=8 sft.py ...                                              # DDP
    torchrun --nproc-per-node=8 sft.py ... --fsdp                                       # FSDP2 (fully_shard)
    deepspeed --num_gpus 8 sft.py ... --deepspeed zero3                                 # DeepSpeed ZeRO

One code path: the same loop drives a plain module, DDP, FSDP2 or a DeepSpeed engine; only wrapping,
gradient sync during accumulation, the optimizer step and checkpoints differ (the `Backend` below).
What it does, in order: load model + tokenizer (`from_pretrained`, offline, fp32 master weights);
tokenize `train.jsonl` through the chat template with the loss on the assistant's tokens only
(optionally packed); train with AdamW, warmup + cosine, clipping, accumulation (each micro-batch
weighted by its share of target tokens over all ranks), bf16 autocast only where the hardware has
native bf16 (else fp32), optional activation checkpointing, logits only where the loss looks; save atomic checkpoints every
`--save-every` steps and resume exactly from one (`--resume`); score held-out exact match of greedy
generations; export the fine-tuned model with `save_pretrained`; report results (`cl.dist.report`).
The data order is a function of the step alone, so a resumed run sees the batches the uninterrupted
one would have seen.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import course_lib as cl
import course_lib.checkpoint  # noqa: F401  (cl.checkpoint, cl.train, cl.zero: not imported by `import course_lib`)
import course_lib.train  # noqa: F401
import course_lib.zero  # noqa: F401
from course_lib import data as D
from course_lib.tokenizer import load_model


def parse_args(argv=None):
    p = cl.dist.argument_parser(__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="local checkpoint directory (config.json, weights, tokenizer)")
    p.add_argument("--data-dir", required=True, help="directory with train.jsonl and eval.jsonl ({'messages': [...]})")
    p.add_argument("--out-dir", required=True, help="checkpoints, TensorBoard events and the final model go here")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=32, help="sequences per rank per micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches accumulated per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 10%% of --steps)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor, as a fraction of --lr")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--seq-len", type=int, default=64, help="truncate (or, with --pack, fill) sequences to this length")
    p.add_argument("--pack", action="store_true", help="join examples into full rows (no padding)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="auto: bf16 autocast where the hardware has native bf16, else fp32")
    p.add_argument("--act-ckpt", action="store_true", help="activation checkpointing (recompute each layer in backward)")
    p.add_argument("--deepspeed", default=None, help="DeepSpeed ZeRO config: a name in course_lib/configs or a .json path")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard per decoder layer)")
    p.add_argument("--eval-n", type=int, default=200, help="held-out conversations scored (0: none)")
    p.add_argument("--eval-before", action="store_true", help="also score the model before training")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", default=None, help="checkpoint directory to resume from ('auto': the latest in --out-dir)")
    p.add_argument("--halt-after", type=int, default=None, help="stop after this step, as if interrupted")
    p.add_argument("--no-export", action="store_true", help="skip saving the final model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per rank")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--log-every", type=int, default=10, help="TensorBoard scalars every N steps")
    args = p.parse_args(argv)
    if args.deepspeed and args.fsdp:
        p.error("choose one of --deepspeed and --fsdp")
    return args


# --- the data order: a function of the step only (exact resume) ----------------------------------
@functools.lru_cache(maxsize=2)
def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def step_indices(step: int, n: int, global_batch: int, seed: int) -> list[int]:
    """Indices of the global batch of `step`: consecutive slices of a stream of per-epoch permutations."""
    start, out = step * global_batch, []
    while len(out) < global_batch:
        epoch, offset = divmod(start + len(out), n)
        out += epoch_order(n, seed, epoch)[offset:offset + global_batch - len(out)]
    return out


# --- the one place where DDP, FSDP2 and DeepSpeed differ -----------------------------------------
class Backend:
    """Wrap the model; run backward (with or without gradient sync); step; save and load checkpoints."""

    def __init__(self, model, args, ctx, bf16: bool):
        self.args, self.ctx, self.bf16 = args, ctx, bf16
        self.kind = "deepspeed" if args.deepspeed else "fsdp" if args.fsdp else "ddp" if ctx.world_size > 1 else "single"
        warmup = args.warmup if args.warmup is not None else args.steps // 10
        schedule = lambda opt: cl.train.warmup_cosine(opt, warmup, args.steps, args.min_lr_ratio)  # noqa: E731
        model.to(ctx.device)
        if self.kind == "deepspeed":
            import deepspeed

            cl.zero.no_jit()
            config = cl.zero.prepare(args.deepspeed, ctx.world_size, micro_batch=args.micro_batch,
                                     accum_steps=args.accum, hidden_size=model.config.hidden_size, lr=args.lr,
                                     weight_decay=args.weight_decay, max_grad_norm=args.clip,
                                     precision="bf16" if bf16 else "fp32")
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                config=config, lr_scheduler=schedule)
            self.model, self.module = self.engine, self.engine.module
            self.bf16 = False  # the engine holds bf16 weights itself: no autocast on top
            return
        if self.kind == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            if ctx.world_size == 1:
                raise SystemExit("--fsdp needs several ranks: launch with torchrun --nproc-per-node=N")
            mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.model = self.module = model
        elif self.kind == "ddp":
            self.model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
            self.module = model
        else:
            self.model = self.module = model
        # the fused AdamW kernel (one op per tensor, not ~10): HF Trainer's default too; FSDP2's DTensors take foreach
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                           weight_decay=args.weight_decay, fused=self.kind != "fsdp" or None)
        self.scheduler = schedule(self.optimizer)

    def sync(self, last: bool):
        """Gradients are averaged over ranks only on the last micro-batch of an accumulation."""
        if self.kind == "ddp" and not last:
            return self.model.no_sync()
        if self.kind == "fsdp":
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def backward(self, loss):
        if self.kind == "deepspeed":
            self.engine.backward(loss, scale_wrt_gas=False)  # our loss is already weighted by its tokens
            self.engine.step()  # steps the optimizer (and schedule) only at the accumulation boundary
        else:
            loss.backward()

    def step(self) -> float:
        """Clip, step, advance the schedule; return the global gradient norm before clipping."""
        if self.kind == "deepspeed":  # clipping and the step happened in engine.step()
            norm = self.engine.get_global_grad_norm()
            return float(norm) if norm is not None else float("nan")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return float(norm)

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def save(self, path: Path, meta: dict) -> None:
        """An atomic checkpoint of everything the run needs to continue (collective)."""
        meta = {**meta, "scheduler": self.scheduler.state_dict()}
        if self.kind == "deepspeed":
            with cl.checkpoint.atomic_directory(path, meta) as tmp:
                self.engine.save_checkpoint(str(tmp), tag="state")
        else:
            cl.checkpoint.save_sharded(path, self.module, self.optimizer, meta=meta)

    def load(self, path: Path) -> dict:
        found = cl.checkpoint.resolve(path)
        if found is None:
            raise SystemExit(f"--resume {path}: no complete checkpoint there")
        if self.kind == "deepspeed":
            self.engine.load_checkpoint(str(found), tag="state")
            meta = cl.checkpoint.read_meta(found)
        else:
            meta = cl.checkpoint.load_sharded(found, self.module, self.optimizer)
            self.scheduler.load_state_dict(meta["scheduler"])
        return meta

    @contextlib.contextmanager
    def full_weights(self):
        """The model with its whole weights, for generation: ZeRO-3 gathers its partitions here;
        FSDP2 gathers layer by layer inside every forward (all ranks generate the same prompts)."""
        if self.kind == "deepspeed" and self.engine.zero_optimization_stage() == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.module.parameters())):
                yield self.module
        else:
            yield self.module

    def export(self, path: Path, tokenizer) -> None:
        """The fine-tuned model as a Hugging Face directory (`from_pretrained` loads it). Collective."""
        if self.kind in ("single", "ddp", "fsdp"):
            cl.checkpoint.save_full(path, self.module, meta={"from": self.args.model_path})
        else:
            with self.full_weights() as module, cl.checkpoint.atomic_directory(path, {"from": self.args.model_path}) as tmp:
                if self.ctx.is_main:
                    state = {k: v.detach().float().cpu() for k, v in module.state_dict().items()}
                    module.save_pretrained(tmp, state_dict=state)
        if self.ctx.is_main:
            tokenizer.save_pretrained(path)


def sft_loss(model, batch: dict) -> torch.Tensor:
    """Mean cross-entropy over the assistant's tokens, with the LM head applied only where it is needed.

    `model(**batch).loss` projects every position onto the vocabulary, prompts included, then throws
    most of it away (label -100). Here the model returns logits only at the positions that predict a
    trained token (`logits_to_keep` with a boolean mask): the same loss, less compute, and for Qwen2.5's
    152k-word vocabulary far less logits memory. Called through the wrapper (DDP, FSDP2, DeepSpeed)."""
    labels = batch["labels"]
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != D.IGNORE  # position p predicts token p + 1
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, logits_to_keep=keep).logits  # (trained tokens, vocabulary)
    return F.cross_entropy(logits.float(), labels[:, 1:][keep[:, :-1]]) if keep.any() else logits.sum() * 0


def all_sum(x: float, ctx) -> float:
    if ctx.world_size == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64, device=ctx.device if ctx.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return float(t.item())


def evaluate(backend: Backend, tokenizer, rows: list[dict]) -> tuple[float, list]:
    """Held-out exact match of greedy generations (every rank generates the same prompts: FSDP2 and
    ZeRO-3 take part in each other's all-gathers, so they must run the same number of forwards)."""
    if not rows:
        return float("nan"), []
    with backend.full_weights() as module:
        return D.exact_match(module, tokenizer, rows)


def latest_checkpoint(out_dir: Path) -> Path | None:
    done = sorted(p for p in out_dir.glob("checkpoint-*") if cl.checkpoint.is_complete(p))
    return done[-1] if done else None


def train(args) -> dict:
    """Run the fine-tune described by `args` (see `parse_args`); return the results dict (on every rank)."""
    ctx = cl.dist.init()
    if args.threads:
        torch.set_num_threads(args.threads)
    cl.seed_everything(args.seed)
    out_dir = Path(args.out_dir)
    model, tokenizer = load_model(args.model_path)
    if args.act_ckpt:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    want_bf16 = {"auto": cl.native_bf16(ctx.device), "bf16": True, "fp32": False}[args.precision]

    files = {"train": str(Path(args.data_dir) / "train.jsonl"), "eval": str(Path(args.data_dir) / "eval.jsonl")}
    raw = D.load_jsonl(files)
    rows = D.tokenize_dataset(raw["train"], tokenizer, args.seq_len)
    if args.pack:
        rows = D.pack(rows, args.seq_len)
    rows = rows.to_list()  # plain lists: fast random access in the loop
    held_out = raw["eval"].to_list()[:args.eval_n]

    n_params = sum(p.numel() for p in model.parameters())  # before sharding hides them
    backend = Backend(model, args, ctx, want_bf16)
    amp = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=backend.bf16)
    start, log = 0, {"step": [], "loss": [], "lr": [], "grad_norm": [], "seconds": [], "cpu_seconds": [], "tokens": [],
                     "batch_tokens": []}
    if args.resume:
        path = latest_checkpoint(out_dir) if args.resume == "auto" else Path(args.resume)
        if path is not None:
            meta = backend.load(path)
            start = meta["step"]
            cl.dist.rprint(f"resumed from {path} at step {start}", ctx=ctx)

    result = {"backend": backend.kind, "world_size": ctx.world_size, "precision": "bf16" if want_bf16 else "fp32",
              "start_step": start, "params": n_params}
    if args.eval_before:
        result["exact_match_before"], _ = evaluate(backend, tokenizer, held_out)

    monitor = cl.train.Monitor("sft", log_dir=out_dir / "tensorboard") if ctx.is_main else None
    per_rank, global_batch = args.micro_batch * args.accum, args.micro_batch * args.accum * ctx.world_size
    stop = min(args.steps, args.halt_after or args.steps)
    bar = None
    if ctx.is_main and not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=stop, initial=start, desc=f"sft {backend.kind} x{ctx.world_size}",
                   mininterval=0.1 if sys.stderr.isatty() else 10)  # piped (a launch): a line every 10 s
    backend.model.train()
    for step in range(start, stop):
        t0, c0 = time.perf_counter(), time.process_time()  # wall, and this process's CPU time
        mine = step_indices(step, len(rows), global_batch, args.seed)[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]
        micro = [D.collate([rows[i] for i in mine[k * args.micro_batch:(k + 1) * args.micro_batch]],
                           tokenizer.pad_token_id) for k in range(args.accum)]
        micro = [{k: v.to(ctx.device) for k, v in mb.items()} for mb in micro]
        counts = [cl.train.count_targets(mb) for mb in micro]
        total = all_sum(sum(counts), ctx)  # target tokens of the whole global batch
        if total == 0:
            raise SystemExit(f"step {step + 1}: the batch has no target tokens (every assistant turn masked or cut "
                             f"off by --seq-len {args.seq_len}): nothing to train on")
        loss_sum = 0.0
        for k, (mb, n) in enumerate(zip(micro, counts)):
            with backend.sync(last=k == args.accum - 1):
                with amp:
                    loss = sft_loss(backend.model, mb)
                # ranks average gradients: x world_size / total makes it the mean over all target tokens
                backend.backward(loss * (n * ctx.world_size / total))
            loss_sum += float(loss.detach()) * n
        lr = backend.lr()
        grad_norm = backend.step()
        loss_value = all_sum(loss_sum, ctx) / total
        tokens = all_sum(sum(int(mb["attention_mask"].sum()) if "attention_mask" in mb else mb["input_ids"].numel()
                             for mb in micro), ctx)  # tokens fed, padding not counted
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        batch_tokens = sum(mb["input_ids"].numel() for mb in micro) * ctx.world_size  # padding included
        for key, value in zip(log, (step + 1, loss_value, lr, grad_norm, seconds, cpu_seconds, tokens, batch_tokens)):
            log[key].append(value)
        if monitor and (step + 1) % args.log_every == 0:
            monitor.log(step + 1, loss=loss_value, lr=lr, grad_norm=grad_norm)
        if bar:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}", refresh=False)
        if args.save_every and (step + 1) % args.save_every == 0 or step + 1 == stop:
            backend.save(out_dir / f"checkpoint-{step + 1:06d}", {"step": step + 1, "loss": loss_value})
    if bar:
        bar.close()
    if monitor:
        monitor.close()

    timed = slice(1, None) if len(log["seconds"]) > 1 else slice(None)  # step 1 warms up allocators and caches
    result.update(log, tokens_per_s=sum(log["tokens"][timed]) / max(1e-9, sum(log["seconds"][timed])),
                  halted=stop < args.steps)
    if stop == args.steps:
        result["exact_match_after"], samples = evaluate(backend, tokenizer, held_out)
        result["samples"] = samples[:8]
        if not args.no_export:
            backend.export(out_dir / "final", tokenizer)
            result["final_dir"] = str(out_dir / "final")
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = train(args)
    if int(os.environ.get("RANK", "0")) == 0:
        cl.dist.report(result)
        summary = {k: result[k] for k in ("backend", "world_size", "tokens_per_s", "exact_match_after") if k in result}
        print(json.dumps(summary, default=float), flush=True)
    cl.dist.close()
    return result


if __name__ == "__main__":
    main()
