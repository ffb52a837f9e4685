"""FSDP2 (`torch.distributed.fsdp.fully_shard`) on a Qwen2 model: what it shards, gathers, saves. Chapter 07.

    torchrun --nproc-per-node=2 fsdp.py --parts all --out-dir /tmp/fsdp07          # CPU, gloo
    torchrun --nproc-per-node=8 fsdp.py --parts memory,grads,dcp --hidden-size 896 ...     # GPUs

Parts (comma separated, or `all`), each a small experiment reported from rank 0 with `cl.dist.report`:
  timeline  gathered (unsharded) parameter bytes at each layer, FSDP2's all-gathers in order (its profiler
            labels) and the bytes one step sends (course_lib.parallel.comm): default, reshard_after_forward=False,
            prefetch, bf16; forwards with and without explicit prefetch, timed in turns
  memory    per-rank bytes of parameter shards, gradient shards and AdamW state after one step
  grads     the full gradients after one step vs one process on the whole batch (fp32)
  mixed     MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): dtypes, loss, bytes
  offload   CPUOffloadPolicy: the default (pinned memory) and pin_memory=False
  dcp       train, save a sharded checkpoint (DCP) half-way, resume freshly built models from it
            (with and without the optimizer state) and compare the loss curves with the straight run
  export    (with dcp) the resumed model's full state dict -> a plain Hugging Face directory, and the
            sharded model's logits beside the plain model's
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import course_lib as cl
from course_lib.parallel.fsdp2 import shard_model  # the lesson: every decoder layer a unit, then the root
from course_lib.memory.measure import local, model_state_bytes

PARTS = ("timeline", "memory", "grads", "mixed", "offload", "dcp", "export")


@dataclass
class Config(cl.config.RecipeConfig, cl.config.ModelSize):
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) on a Qwen2 model: what it shards, gathers, saves. Chapter 07."""

    chapter = "07"
    parts: str = cl.config.opt("all", f"comma-separated: {', '.join(PARTS)}, or all")
    out_dir: str = cl.config.opt("build/fsdp07", "where checkpoints are written")
    steps: int = cl.config.preset("training steps of the checkpoint/resume experiment (resumed half-way)")
    micro_batch: int = cl.config.preset("sequences per rank")
    seq_len: int = cl.config.preset("tokens per sequence")
    lr: float = cl.config.opt(1e-3, "AdamW learning rate")
    seed: int = cl.config.preset("seed of the model and the data")
    prefetch_repeat: int = cl.config.preset("forwards timed with and without prefetch, in turns")

    def part_list(self) -> tuple[str, ...]:
        return PARTS if self.parts == "all" else tuple(p.strip() for p in self.parts.split(","))

    def check(self) -> None:
        unknown = set(self.part_list()) - set(PARTS)
        if unknown:
            raise cl.config.ConfigError(f"unknown part(s) {', '.join(sorted(unknown))}: choose from {', '.join(PARTS)}")
        if "export" in self.part_list() and "dcp" not in self.part_list():
            raise cl.config.ConfigError("--parts export exports the model resumed from the DCP checkpoint: add dcp")
        if self.steps < 2:
            raise cl.config.ConfigError(f"--steps {self.steps}: need at least 2 (the checkpoint is saved half-way)")


# --- measuring -------------------------------------------------------------------------------------------
def state_bytes(model, optimizer) -> dict:
    """What this rank holds between steps: parameter shards, gradient shards, optimizer state."""
    out = model_state_bytes(model, optimizer)
    out["step_counters"] = sum(1 for s in optimizer.state.values() if torch.is_tensor(s.get("step")))
    return out


def unsharded_bytes(model) -> int:
    """Bytes of parameters currently gathered (FSDP2 swaps in plain tensors while a unit is unsharded)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))


def norm(tensors) -> torch.Tensor:
    """The L2 norm of several tensors together (in float64)."""
    return sum((t.double() ** 2).sum() for t in tensors) ** 0.5


def unsharded_dtypes(model) -> list[str]:
    return sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if not isinstance(p, DTensor)})


# --- data and steps --------------------------------------------------------------------------------------
def global_batch(args, step: int, world_size: int) -> dict:
    """The batch of `step` over all ranks (the same on every rank): one process's batch, to compare with."""
    return cl.models.random_batch(args.vocab_size, args.micro_batch * world_size, args.seq_len, seed=1000 + step)


def my_share(args, step: int, ctx) -> dict:
    """This rank's contiguous slice of the global batch of `step`."""
    batch, n = global_batch(args, step, ctx.world_size), args.micro_batch
    return {k: v[ctx.rank * n:(ctx.rank + 1) * n].to(ctx.device) for k, v in batch.items()}


def build(args, ctx, seed: int | None = None):
    """The Qwen2 model every part starts from: same seed, same weights, on this rank's device."""
    return cl.models.tiny_qwen2(seed=args.seed if seed is None else seed, **args.size()).to(ctx.device)


def train_steps(model, optimizer, args, ctx, steps) -> list[float]:
    losses = []
    for step in steps:
        loss = fwd_bwd(model, my_share(args, step, ctx))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(cl.dist.all_reduce_scalar(loss.item(), "mean"))
    return losses


def fwd_bwd(model, batch):
    model.zero_grad()  # a warm-up's gradients do not add up
    (loss := model(**batch).loss).backward()
    return loss


def adamw(model, args):
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


# --- the parts -------------------------------------------------------------------------------------------
def fsdp_trace(prof) -> list[str]:
    """FSDP2's own profiler labels, in the order they ran: which unit gathers (all_gather), prefetches, reduces."""
    keep = ("FSDP::pre_forward", "FSDP::pre_backward", "FSDP::all_gather", "FSDP::forward_prefetch",
            "FSDP::backward_prefetch", "FSDP::post_backward_reduce")
    events = sorted((e for e in prof.events() if e.name.startswith(keep) and "copy_out" not in e.name),
                    key=lambda e: e.time_range.start)
    names = [e.name.replace("FSDP::", "").replace("model.layers.", "L") for e in events]
    return [n if ("(" in n or " for " in n) else f"{n} (root)" for n in names]


def part_timeline(args, ctx, mesh) -> dict:
    """Gathered-parameter bytes at every layer boundary and FSDP2's gathers in order; the bytes one step sends,
    counted at the process group (course_lib.parallel.comm); forwards with and without explicit prefetch, timed
    in turns (`cl.timing.interleaved`)."""
    out, timed = {}, {}
    for mode in ("default", "keep", "prefetch", "bf16"):
        model = shard_model(build(args, ctx), mesh, reshard_after_forward=False if mode == "keep" else None,
                            mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mode == "bf16" else None)
        layers = list(model.model.layers)
        for i, layer in enumerate(layers if mode == "prefetch" else []):  # gather layer i+1 when i starts (i-1 in bwd)
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 2])
            layer.set_modules_to_backward_prefetch(layers[max(i - 1, 0):i])
        events = []

        def probe(name):
            if len(events) < 2 * len(layers) + 3:  # the first step only
                events.append((name, unsharded_bytes(model)))

        def on_output(layer_output, i):
            out = layer_output[0] if isinstance(layer_output, tuple) else layer_output
            out.register_hook(lambda grad: probe(f"bwd L{i}"))  # returns None: the output stays as it is

        handles = []
        for i, layer in enumerate(layers):
            # registered after fully_shard: runs after FSDP2's own pre-forward hook (the gather)
            handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: probe(f"fwd L{i}")))
            # a hook on the layer's output gradient runs after FSDP2's pre-backward gather of this layer
            handles.append(layer.register_forward_hook(lambda m, a, o, i=i: on_output(o, i)))
        batch = my_share(args, 0, ctx)
        with cl.timing.quiet_profile() as prof:
            probe("start")
            loss = model(**batch).loss
            probe("after fwd")
            loss.backward()
            probe("after bwd")
        for h in handles:
            h.remove()
        with cl.comm.CommCounter() as comm:  # one more step: what it sends, counted at the process group
            model(**batch).loss.backward()
        out[mode] = {"events": events, "peak": max(b for _, b in events), "trace": fsdp_trace(prof),
                     "comm": cl.comm.traffic(comm)}
        if mode in ("default", "prefetch"):
            timed[mode] = model
        if mode == "default":  # unsharded sizes (a DTensor's numel() is its global size)
            full = lambda params: sum(p.numel() * p.element_size() for p in params)  # noqa: E731
            out.update(layer_bytes=full(layers[0].parameters()), full_bytes=full(model.parameters()))
            out["root_bytes"] = out["full_bytes"] - full(p for layer in layers for p in layer.parameters())
            out["layer_shard_shape"] = list(local(layers[0].mlp.up_proj.weight).shape)
            out["layer_global_shape"] = list(layers[0].mlp.up_proj.weight.shape)

    def forward(model):  # the ranks start together; a forward alone: gathers and compute, no backward
        def run():
            dist.barrier()
            with torch.no_grad():
                model(**batch)
        return run

    spreads = cl.timing.interleaved({m: forward(timed[m]) for m in timed}, repeat=args.prefetch_repeat)
    for m, spread in spreads.items():  # every rank's seconds: the notebook compares the slower rank's
        out[m]["forward_s_ranks"] = cl.dist.gather(spread.samples, ctx)
    out["layer_shard_shapes"] = cl.dist.gather(out["layer_shard_shape"], ctx)
    return out


def part_memory_grads(args, ctx, mesh, parts) -> dict:
    """One AdamW step on the sharded model: bytes held per rank, and the gradients vs one process."""
    out = {}
    model = shard_model(build(args, ctx), mesh)
    optimizer = adamw(model, args)
    loss = model(**my_share(args, 0, ctx)).loss
    loss.backward()
    out["loss"] = cl.dist.all_reduce_scalar(loss.item(), "mean")
    if "grads" in parts:
        sharded = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # all-gathers: collective
        if ctx.is_main:
            ref = build(args, ctx)  # one process, the whole batch, the same initial weights
            ref_loss = ref(**{k: v.to(ctx.device) for k, v in global_batch(args, 0, ctx.world_size).items()}).loss
            ref_loss.backward()
            ref_grads = dict(ref.named_parameters())
            diffs = {n: (g - ref_grads[n].grad).abs().max().item() for n, g in sharded.items()}
            num, den = norm(sharded.values()), norm(ref_grads[n].grad for n in sharded)
            rel = max(((g - ref_grads[n].grad).norm() / ref_grads[n].grad.norm()).item() for n, g in sharded.items())
            out["grads"] = {"max_abs_diff": max(diffs.values()), "max_rel_diff": rel,
                            "norm_ratio": (num / den).item(), "ref_loss": ref_loss.item(),
                            "worst_param": max(diffs, key=diffs.get), "ref_max_abs": max(
                                ref_grads[n].grad.abs().max().item() for n in sharded)}
        dist.barrier()
    optimizer.step()  # AdamW state is created now, shaped like the shards
    if "memory" in parts:
        per_rank = cl.dist.gather(state_bytes(model, optimizer), ctx)
        out["memory"] = {"per_rank": per_rank, "num_params": sum(p.numel() for p in model.parameters()),
                         "param_tensors": len(list(model.parameters())),
                         "placements": str(next(model.parameters()).placements)}
    return out


def part_mixed(args, ctx, mesh) -> dict:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard_model(build(args, ctx), mesh, mp_policy=policy)
    optimizer = adamw(model, args)
    seen, batch = [], my_share(args, 0, ctx)
    model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.extend(unsharded_dtypes(m)))
    loss, seconds = cl.timing.timed(lambda: fwd_bwd(model, batch))  # after a warm-up step (lazy init), synchronized
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    optimizer.step()
    p = next(model.parameters())
    out = {"loss": cl.dist.all_reduce_scalar(loss.item(), "mean"), "fwd_bwd_s": seconds, "sharded_param_dtype": str(local(p).dtype),
           "gathered_param_dtype": sorted(set(seen)), "grad_dtype": str(local(p.grad).dtype),
           "optim_dtype": str(local(optimizer.state[p]["exp_avg"]).dtype),
           "per_rank": cl.dist.gather(state_bytes(model, optimizer), ctx)}
    # bf16 vs fp32 gradients (the fp32 run of the same step), on rank 0
    ref = shard_model(build(args, ctx), mesh)
    out["fp32_fwd_bwd_s"] = cl.timing.time_it(lambda: fwd_bwd(ref, batch), repeat=1)  # after a warm-up step
    ref_grads = {n: p.grad.full_tensor() for n, p in ref.named_parameters()}
    out["grad_rel_err_vs_fp32"] = (norm(grads[n] - ref_grads[n] for n in grads) / norm(ref_grads.values())).item()
    return out


def part_offload(args, ctx, mesh, fp32_loss: float | None) -> dict:
    out = {}
    try:  # the default pins host memory for fast copies to the GPU: it needs an accelerator
        model = shard_model(build(args, ctx), mesh, offload_policy=CPUOffloadPolicy())
        model(**my_share(args, 0, ctx)).loss.backward()
        out["default_policy"] = "ran"
    except Exception as e:  # noqa: BLE001 (the error is the lesson)
        out["default_policy"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    dist.barrier()
    pin = torch.cuda.is_available()
    base = torch.cuda.memory_allocated() if pin else 0
    model = shard_model(build(args, ctx), mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin))
    optimizer = adamw(model, args)
    loss = model(**my_share(args, 0, ctx)).loss
    loss.backward()
    optimizer.step()  # runs on the CPU, where the shards and their gradients live
    p = next(model.parameters())
    out.update(pin_memory=pin, loss=cl.dist.all_reduce_scalar(loss.item(), "mean"), param_device=str(local(p).device),
               grad_device=str(local(p.grad).device), per_rank=cl.dist.gather(state_bytes(model, optimizer), ctx),
               device_bytes_after_step=(torch.cuda.memory_allocated() - base) if pin else None,
               loss_diff_vs_no_offload=None if fp32_loss is None else abs(cl.dist.all_reduce_scalar(loss.item(), "mean") - fp32_loss))
    return out


def part_dcp(args, ctx, mesh, out_dir: Path, export: bool) -> dict:
    """Train, saving a sharded checkpoint half-way; then resume freshly built (differently initialized)
    models from it, with and without the optimizer state, and compare the loss curves. With `export`,
    the resumed model is also exported as a full state dict right after loading (see `export`)."""
    steps, half = args.steps, args.steps // 2
    ckpt = out_dir / "dcp"
    model = shard_model(build(args, ctx), mesh)
    optimizer = adamw(model, args)
    straight = train_steps(model, optimizer, args, ctx, range(half))
    start = time.perf_counter()
    cl.checkpoint.save_sharded(ckpt, model, optimizer, meta={"step": half, "loss": straight[-1]})
    save_s = time.perf_counter() - start
    straight += train_steps(model, optimizer, args, ctx, range(half, steps))  # saving changed nothing
    del model, optimizer

    out = {"steps": steps, "resume_at": half, "straight": straight, "resumed": {}, "save_s": save_s,
           "files": sorted((p.name, p.stat().st_size) for p in ckpt.iterdir()), "path": str(ckpt)}
    for what in ("model+optimizer", "model only"):
        model = shard_model(build(args, ctx, seed=args.seed + 1), mesh)  # other weights: the load must replace them
        optimizer = adamw(model, args)
        meta = cl.checkpoint.load_sharded(ckpt, model, optimizer if what == "model+optimizer" else None)
        if export and what == "model+optimizer":
            out["export"] = part_export(model, args, ctx, out_dir, meta["step"])
        out["resumed"][what] = train_steps(model, optimizer, args, ctx, range(meta["step"], steps))
        del model, optimizer
    return out


def part_export(model, args, ctx, out_dir: Path, step: int) -> dict:
    """The sharded model's full state dict as a plain Hugging Face directory; its logits beside a plain model's."""
    hf_dir = out_dir / "hf"
    cl.checkpoint.save_full(hf_dir, model, meta={"step": step})
    batch = global_batch(args, 99, ctx.world_size)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"].to(ctx.device)).logits  # same input on every rank
    out = {"path": str(hf_dir), "step": step, "files": sorted(p.name for p in hf_dir.iterdir())}
    if ctx.is_main:
        from transformers import AutoModelForCausalLM

        torch.save({"input_ids": batch["input_ids"], "logits": logits.cpu()}, out_dir / "fsdp_logits.pt")
        plain = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(ctx.device)
        with torch.no_grad():
            plain_logits = plain(input_ids=batch["input_ids"].to(ctx.device)).logits
        out.update(plain_class=type(plain).__name__, max_abs_logit_diff=(plain_logits - logits).abs().max().item())
    return out


def main(argv=None) -> None:
    args = Config.parse(argv)
    parts = args.part_list()
    ctx = cl.dist.init(group_of_one=True)  # one process too: FSDP2 needs a (one-rank) process group
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    import psutil
    import transformers  # noqa: F401  (imported here, so that its import time counts as start-up, not as a part)

    startup = time.time() - psutil.Process().create_time()
    result = {"world_size": ctx.world_size, "device": str(ctx.device), "parts": list(parts),
              "seconds": {"startup": startup}}
    run = {"timeline": lambda: part_timeline(args, ctx, mesh),
           "memory_grads": lambda: part_memory_grads(args, ctx, mesh, parts),
           "mixed": lambda: part_mixed(args, ctx, mesh),
           "offload": lambda: part_offload(args, ctx, mesh, result.get("memory_grads", {}).get("loss")),
           "dcp": lambda: part_dcp(args, ctx, mesh, Path(args.out_dir), export="export" in parts)}
    for part in parts:
        key = "memory_grads" if part in ("memory", "grads") else part
        if part == "export" or key in result:
            continue  # export is done inside dcp; memory and grads share one experiment
        start = time.perf_counter()
        cl.dist.rprint(f"--- {part}", ctx=ctx)
        result[key] = run[key]()
        result["seconds"][part] = time.perf_counter() - start
    cl.dist.finish(result)


if __name__ == "__main__":
    main()
    cl.dist.exit_now()  # (skips the interpreter's teardown: see exit_now)
