"""Train a small Qwen2 with DeepSpeed ZeRO under several configs, one fresh engine each; per rank, report
the losses and the bytes of parameters, gradients and optimizer state held (chapter 06).

    torchrun --nproc-per-node=2 zero.py --configs zero0,zero1,zero2,zero3 --steps 3
    deepspeed --num_gpus 8 zero.py --configs zero3_offload --hidden-size 896 ...

A config is a name from course_lib/parallel/configs/ (or a path to a DeepSpeed JSON), optionally with a precision
and `zero_optimization` overrides: `zero1:fp32`, `zero2+use_multi_rank_bucket_allreduce=false`. Its "auto"
values are resolved from these flags, and it is validated, before DeepSpeed sees it. The last step of each
config is also counted (course_lib.parallel.comm): the bytes of every collective DeepSpeed starts and, for offload
configs, of every copy between the device and the host tier. A config at the run's precision without overrides then
times --timed-steps more steps with nothing measuring inside them (after the losses: those stay as they are).
With --checkpoint-dir, each config also saves a checkpoint after --save-at steps, then a fresh
engine loads it and trains the remaining steps again (its losses must equal the uninterrupted ones),
and rank 0 stores the model's logits on a probe batch at the checkpoint (to test zero_to_fp32).
"""
import json
import os
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import course_lib as cl
from course_lib.parallel import zero


@dataclass
class Config(cl.config.RecipeConfig, cl.config.ModelSize):
    """Train a small Qwen2 with DeepSpeed ZeRO under several configs, one fresh engine each (chapter 06)."""

    chapter = "06"
    configs: str = cl.config.opt("zero0,zero1,zero2,zero3", "comma-separated config[:precision]")
    precision: str = cl.config.opt("bf16", "bf16, fp16 or fp32 (a config's own :precision wins)")
    steps: int = cl.config.preset("optimizer steps per config")
    micro_batch: int = cl.config.preset("sequences per rank per micro-batch")
    accum: int = cl.config.preset("micro-batches per optimizer step")
    seq_len: int = cl.config.preset("tokens per sequence")
    lr: float = cl.config.preset("AdamW learning rate")
    persistence_threshold: int | None = cl.config.preset("ZeRO-3: parameters smaller stay whole (None: auto, 10·h)")
    seed: int = cl.config.preset("seed of the model and the data")
    checkpoint_dir: str | None = cl.config.opt(None, "checkpoint runs go under this folder")
    checkpoint_configs: str = cl.config.opt("", "comma-separated config[:precision] to checkpoint")
    save_at: int = cl.config.preset("with --checkpoint-dir: save after this many steps")
    timed_steps: int = cl.config.opt(5, "steps timed with nothing measuring inside them, after the counted step "
                                        "(not in the losses)")

    def check(self) -> None:
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise cl.config.ConfigError(f"--precision must be bf16, fp16 or fp32, got {self.precision!r}")
        for spec in filter(None, (self.configs + "," + self.checkpoint_configs).split(",")):
            parse_spec(spec, self.precision)  # an unknown config: one ZeroConfigError line, before any rank


def parse_spec(spec: str, precision: str) -> tuple[str, str, dict]:
    """`name[:precision][+key=value...]` -> (config name, precision, zero_optimization overrides)."""
    head, *overrides = spec.split("+")
    name, _, prec = head.partition(":")
    zero.config_path(name)
    extra = {}
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise cl.config.ConfigError(f"{spec!r}: an override is key=value, e.g. zero2+reduce_scatter=false")
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            raise cl.config.ConfigError(f"{spec!r}: {value!r} is not a JSON value (true, false, 0, ...)") from None
    return name, prec or precision, extra


def batches(args, ctx, step: int) -> list[dict]:
    """The micro-batches of one optimizer step on this rank: the same for every config."""
    return [cl.models.random_batch(args.vocab_size, args.micro_batch, args.seq_len,
                                   seed=args.seed + 1000 * step + 10 * micro + ctx.rank, device=ctx.device)
            for micro in range(args.accum)]


def build(args, ctx, spec: str):
    name, precision, overrides = parse_spec(spec, args.precision)
    config = zero.prepare(name, ctx.world_size, micro_batch=args.micro_batch, accum_steps=args.accum,
                          hidden_size=args.hidden_size, lr=args.lr, precision=precision,
                          persistence_threshold=args.persistence_threshold)
    # one process builds every config in turn and their losses are compared bit for bit: keep PyTorch's linear
    # (stage 3's default, DeepSpeed's own linear, replaces torch.nn.functional.linear process-wide; chapter 06)
    config["zero_optimization"].update({"memory_efficient_linear": False, **overrides})
    model = cl.models.tiny_qwen2(seed=args.seed, **args.size())
    engine, *_ = zero.initialize(model, config)
    return engine, config


def train_step(args, ctx, engine, step: int, peak=None, times=None) -> tuple[float, dict | None]:
    """One optimizer step (all micro-batches); the mean loss over ranks, and, with `peak` (measuring), what was held
    before step(). `times` (a dict) receives the step's seconds and the optimizer step's (the boundary's
    `engine.step()`)."""
    losses, before, start = [], None, time.perf_counter()
    for micro, batch in enumerate(batches(args, ctx, step)):
        if peak is not None:
            peak.phase = "one_backward" if micro == 0 else "accumulating"
        loss = engine(**batch).loss
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary and peak is not None:
            before = zero.held_bytes(engine)
        t = time.perf_counter()
        engine.step()
        if boundary and times is not None:
            times["optimizer_s"] = time.perf_counter() - t
        losses.append(loss.detach().float())
    if times is not None:
        times["step_s"] = time.perf_counter() - start
    return cl.dist.all_reduce_scalar(torch.stack(losses).mean().item(), "mean"), before


def host_tier(engine) -> set[int]:
    """Storages DeepSpeed keeps in the offload (host) tier: the fp32 master partition and its gradient,
    the optimizer's state, the CPU gradient accumulators, and (offload_param) the parameter shards."""
    opt = engine.optimizer
    tensors = cl.measure.flat_tensors([getattr(opt, n, None) or [] for n in ("single_partition_of_fp32_groups",
                                                                 "fp32_partitioned_groups_flat")])
    tensors += [t.grad for t in tensors if t.grad is not None]
    tensors += cl.measure.flat_tensors([getattr(opt, n, None) or {} for n in ("accumulated_grads_in_cpu",
                                                                              "offload_gradient_dict")])
    tensors += cl.measure.optimizer_state_tensors(getattr(opt, "optimizer", opt))
    if engine.zero_optimization_stage() == 3 and getattr(opt, "offload_param", False):
        tensors += [p.ds_tensor for p in engine.module.parameters()]
    return {t.untyped_storage().data_ptr() for t in tensors}


class TierCopies(TorchDispatchMode):
    """Bytes copied between the device and the host tier (`host_tier`) inside the block, each counted at its
    source's size: `to_host` (gradients going out), `to_device` (updated weights coming back). A collective
    reading a host-tier tensor (ZeRO-3's offloaded shards feeding an all-gather) counts as `to_device`: on a
    GPU the shard must cross first. On this CPU-only machine both tiers are one RAM: the copies still run."""

    def __init__(self, host: set[int]):
        super().__init__()
        self.host, self.to_host, self.to_device = host, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name == "copy_":
            dst, src = args[0], args[1]
            in_host = [t.untyped_storage().data_ptr() in self.host for t in (dst, src)]
            if in_host == [True, False]:
                self.to_host += src.numel() * src.element_size()
            elif in_host == [False, True]:
                self.to_device += src.numel() * src.element_size()
        elif name == "_allgather_base_" and args[1].untyped_storage().data_ptr() in self.host:
            self.to_device += args[1].numel() * args[1].element_size()
        return func(*args, **(kwargs or {}))


def step_grad_probe(engine) -> dict:
    """Bytes of the gradients the inner (torch) optimizer sees inside step(): ZeRO hands it fp32 ones.
    `seen["remove"]()` puts the optimizer's own step back."""
    inner, seen = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer, {"bytes": 0}
    original = inner.step

    def step(*a, **k):
        grads = [p.grad for g in inner.param_groups for p in g["params"]]
        seen["bytes"] = max(seen["bytes"], cl.tensor_bytes(grads))
        return original(*a, **k)

    inner.step = step
    seen["remove"] = lambda: setattr(inner, "step", original)
    return seen


def layout(engine) -> dict:
    """Where ZeRO-1/2 cut the flat parameter list: the elements of whole parameters this rank's
    gradient buffer covers (`grads_in_partition` holds a parameter that straddles the cut whole)."""
    opt = engine.optimizer
    if not hasattr(opt, "params_in_partition"):
        return {}
    return {"in_partition_numel": sum(p.numel() for g in opt.params_in_partition for p in g),
            "partition_numel": sum(int(s) for s in opt.partition_size)}


def measure(args, ctx, spec: str) -> dict:
    """Train --steps steps under one config; count what each rank holds (cl.zero.held_bytes); count the last
    step's collectives (and, with offload, its copies between the tiers); then time --timed-steps plain steps."""
    name, precision, overrides = parse_spec(spec, args.precision)
    start = time.perf_counter()
    engine, config = build(args, ctx, spec)
    init_seconds = time.perf_counter() - start
    peak, inside_step = zero.GradPeak(engine), step_grad_probe(engine)
    losses = []
    offload = any("offload" in k for k in config["zero_optimization"])
    for step in range(args.steps):
        if step < args.steps - 1:
            loss, before = train_step(args, ctx, engine, step, peak)  # before: held before step()
        else:  # the last step: its collectives and its copies between the tiers counted
            with cl.comm.CommCounter() as comm, TierCopies(host_tier(engine) if offload else set()) as tiers:
                loss, before = train_step(args, ctx, engine, step, peak)
        losses.append(loss)
    peak.remove()  # from here on nothing measures inside a step: the hooks and the probe are gone
    inside_step["remove"]()
    timing = []
    if precision == args.precision and not overrides:  # a config chapter 06 times
        for extra in range(args.timed_steps):  # after the counted step: the losses stay as they are
            timing.append({})
            train_step(args, ctx, engine, args.steps + extra, times=timing[-1])
    after = zero.held_bytes(engine)  # after step(): the optimizer state exists
    held = {"params": after["params"], "optimizer": after["optimizer"],
            "grads_kept": before["grads"],  # what step() consumes
            "grads_peak": peak.bytes["one_backward"],  # the most held during one backward
            "grads_peak_accumulating": peak.bytes.get("accumulating", 0),  # ... and during the later micro-batches
            "step_grads": inside_step["bytes"],  # the fp32 gradients the inner optimizer steps with
            "host": after["host"], **layout(engine)}
    held["device"] = held["params"] + held["grads_kept"] + held["optimizer"] - held["host"]
    numels = [getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()]
    traffic = {"summary": comm.summary(), "bytes": comm.total(), "calls": len(comm.calls), "to_host": tiers.to_host,
               "to_device": tiers.to_device,
               # each timed step, and the boundary's engine.step() in it: the slower rank's seconds
               "step_samples_s": [cl.dist.all_reduce_scalar(t["step_s"], "max") for t in timing],
               "optimizer_samples_s": [cl.dist.all_reduce_scalar(t["optimizer_s"], "max") for t in timing]}
    out = {"config": name + "".join(f"+{k}={json.dumps(v)}" for k, v in overrides.items()),
           "precision": precision, "stage": engine.zero_optimization_stage(),
           "num_params": sum(numels), "largest_param": max(numels), "losses": losses,
           "ranks": cl.dist.gather(held, ctx), "init_seconds": init_seconds, "overrides": overrides,
           "seconds": time.perf_counter() - start, "resolved": config, "comm": cl.dist.gather(traffic, ctx)}
    engine.destroy()
    return out


def checkpoint(args, ctx, spec: str) -> dict:
    """Save after --save-at steps, go on; then a fresh engine loads the checkpoint and redoes the rest."""
    name, precision, _ = parse_spec(spec, args.precision)
    ckpt = f"{args.checkpoint_dir}/{name}"
    probe = cl.models.random_batch(args.vocab_size, 2, args.seq_len, seed=12345, device=ctx.device)
    engine, _ = build(args, ctx, spec)
    full = []
    for step in range(args.steps):
        full.append(train_step(args, ctx, engine, step)[0])
        if step + 1 == args.save_at:
            engine.save_checkpoint(ckpt, tag=f"step{args.save_at}")
            with torch.no_grad():
                logits = engine(input_ids=probe["input_ids"]).logits.float().cpu()
            if ctx.is_main:
                torch.save({"input_ids": probe["input_ids"].cpu(), "logits": logits}, f"{ckpt}/probe.pt")
    engine.destroy()
    engine, _ = build(args, ctx, spec)
    load_path, client = engine.load_checkpoint(ckpt, tag=f"step{args.save_at}")
    resumed = [train_step(args, ctx, engine, step)[0] for step in range(args.save_at, args.steps)]
    engine.destroy()
    return {"config": name, "precision": precision, "dir": ckpt, "tag": f"step{args.save_at}",
            "losses": full, "resumed": resumed, "loaded": load_path is not None}


def main(argv=None) -> None:
    args = Config.parse(argv)
    # Nothing here uses torch.compile, but DeepSpeed's ZeRO optimizer check imports a module that decorates
    # functions with it at import time, which loads TorchInductor (~10 s a process); this makes those no-ops.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    zero.no_jit()
    cl.env.deterministic()  # exact resume on a GPU too (section 6), set before CUDA starts (cl.dist.init)
    ctx = cl.dist.init(group_of_one=True)  # one process too: the group DeepSpeed would otherwise look for itself
    runs, checkpoints = [], []
    for spec in filter(None, args.configs.split(",")):
        runs.append(measure(args, ctx, spec))
        cl.dist.rprint(f"{spec}: losses {[round(x, 5) for x in runs[-1]['losses']]}  (model + engine built in "
                       f"{runs[-1]['init_seconds']:.1f} s, all {runs[-1]['seconds']:.1f} s)", ctx=ctx)
    for spec in filter(None, args.checkpoint_configs.split(",")):
        checkpoints.append(checkpoint(args, ctx, spec))
        cl.dist.rprint(f"{spec}: losses {[round(x, 5) for x in checkpoints[-1]['losses']]}, resumed "
                       f"{[round(x, 5) for x in checkpoints[-1]['resumed']]}", ctx=ctx)
    cl.dist.finish({"world_size": ctx.world_size, "runs": runs, "checkpoints": checkpoints})


if __name__ == "__main__":
    main()
    cl.dist.exit_now()  # (skips the interpreter's teardown: see exit_now)
