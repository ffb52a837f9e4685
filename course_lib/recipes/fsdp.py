"""FSDP2 (`torch.distributed.fsdp.fully_shard`) on a Qwen2 model: what it shards, gathers, saves. Chapter 07.

    torchrun --nproc-per-node=2 fsdp.py --parts all --out-dir /tmp/fsdp07          # CPU, gloo
    torchrun --nproc-per-node=8 fsdp.py --parts memory,grads,dcp --model '{"hidden_size": 896, ...}'   # GPUs

Parts (comma separated, or `all`), each a small experiment reported from rank 0 with `cl.dist.report`:
  timeline  bytes of gathered (unsharded) parameters at each layer, forward and backward, and FSDP2's
            all-gathers in order (its profiler labels), for the default reshard_after_forward, for
            False, and with explicit forward/backward prefetching
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

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import course_lib as cl
import course_lib.checkpoint  # noqa: F401  (cl.checkpoint)

PARTS = ("timeline", "memory", "grads", "mixed", "offload", "dcp", "export")


# --- the lesson: shard every decoder layer, then the root ---------------------------------------------
def shard_model(model, mesh, reshard_after_forward: bool | None = None, mp_policy: MixedPrecisionPolicy | None = None,
                offload_policy=None):
    """FSDP2: each `Qwen2DecoderLayer` becomes one unit (gathered and freed together), then the root
    takes what is left (embeddings, final norm, the tied head). Parameters become sharded DTensors.
    `reshard_after_forward=None` is FSDP2's default: True for the layers (free after forward, gather
    again in backward), False for the root (its parameters are needed again first thing in backward)."""
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


# --- measuring -------------------------------------------------------------------------------------------
def local(t: torch.Tensor) -> torch.Tensor:
    """The piece of a tensor this rank holds (a DTensor's local shard, or the tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(tensors) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)


def state_bytes(model, optimizer) -> dict:
    """What this rank holds between steps: parameter shards, gradient shards, optimizer state."""
    params = list(model.parameters())
    opt = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    out = {"params": nbytes(params), "grads": nbytes(p.grad for p in params), "optimizer": nbytes(opt),
           "step_counters": sum(1 for s in optimizer.state.values() if torch.is_tensor(s.get("step")))}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def unsharded_bytes(model) -> int:
    """Bytes of parameters currently gathered (FSDP2 swaps in plain tensors while a unit is unsharded)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))


def unsharded_dtypes(model) -> list[str]:
    return sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if not isinstance(p, DTensor)})


def global_mean(x: float) -> float:
    """The mean of a scalar over ranks (each rank holds an equal share of the batch)."""
    t = torch.tensor([float(x)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


# --- data and steps --------------------------------------------------------------------------------------
def global_batch(args, step: int) -> dict:
    vocab = json.loads(args.model).get("vocab_size", cl.presets.TINY["vocab_size"])
    return cl.models.random_batch(vocab, args.batch_size, args.seq_len, seed=1000 + step)


def my_share(batch: dict, ctx) -> dict:
    """This rank's contiguous slice of the global batch (the batch must split evenly)."""
    n = batch["input_ids"].shape[0] // ctx.world_size
    return {k: v[ctx.rank * n:(ctx.rank + 1) * n].to(ctx.device) for k, v in batch.items()}


def build(args, ctx, seed: int | None = None):
    """The Qwen2 model every part starts from: same seed, same weights, on this rank's device."""
    size = {**cl.presets.TINY, **json.loads(args.model)}
    return cl.models.tiny_qwen2(seed=args.seed if seed is None else seed, **size).to(ctx.device)


def train_steps(model, optimizer, args, ctx, steps) -> list[float]:
    losses = []
    for step in steps:
        loss = model(**my_share(global_batch(args, step), ctx)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(global_mean(loss.item()))
    return losses


def adamw(model, args):
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


# --- the parts -------------------------------------------------------------------------------------------
@contextmanager
def _native_stderr_silenced():
    """Point file descriptor 2 at /dev/null for a moment (C++ libraries write there directly)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextmanager
def cpu_profile():
    """`torch.profiler` (CPU events), minus the two "profiler_start/stop" lines kineto prints on each use."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with _native_stderr_silenced():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _native_stderr_silenced():
            prof.__exit__(None, None, None)


def fsdp_trace(prof) -> list[str]:
    """FSDP2's own profiler labels, in the order they ran: which unit gathers (all_gather), prefetches, reduces."""
    keep = ("FSDP::pre_forward", "FSDP::pre_backward", "FSDP::all_gather", "FSDP::forward_prefetch",
            "FSDP::backward_prefetch", "FSDP::post_backward_reduce")
    events = sorted((e for e in prof.events() if e.name.startswith(keep) and "copy_out" not in e.name),
                    key=lambda e: e.time_range.start)
    out = []
    for e in events:
        name = e.name.replace("FSDP::", "").replace("model.layers.", "L")
        out.append(name if ("(" in name or " for " in name) else f"{name} (root)")
    return out


def part_timeline(args, ctx, mesh) -> dict:
    """Gathered-parameter bytes at every layer boundary, and FSDP2's gathers in order, for three settings."""
    out = {}
    for mode in ("default", "keep", "prefetch"):
        model = shard_model(build(args, ctx), mesh, reshard_after_forward=False if mode == "keep" else None)
        layers = list(model.model.layers)
        if mode == "prefetch":  # explicitly: gather layer i+1 when layer i starts (and i-1 in backward)
            for i, layer in enumerate(layers):
                if i + 1 < len(layers):
                    layer.set_modules_to_forward_prefetch([layers[i + 1]])
                if i > 0:
                    layer.set_modules_to_backward_prefetch([layers[i - 1]])
        events = []

        def probe(name):
            events.append((name, unsharded_bytes(model)))

        def on_output(layer_output, i):
            out = layer_output[0] if isinstance(layer_output, tuple) else layer_output
            out.register_hook(lambda grad: probe(f"bwd L{i}"))  # returns None: the output stays as it is

        for i, layer in enumerate(layers):
            # registered after fully_shard: runs after FSDP2's own pre-forward hook (the gather)
            layer.register_forward_pre_hook(lambda m, a, i=i: probe(f"fwd L{i}"))
            # a hook on the layer's output gradient runs after FSDP2's pre-backward gather of this layer
            layer.register_forward_hook(lambda m, a, o, i=i: on_output(o, i))
        batch = my_share(global_batch(args, 0), ctx)
        with cpu_profile() as prof:
            probe("start")
            loss = model(**batch).loss
            probe("after fwd")
            loss.backward()
            probe("after bwd")
        out[mode] = {"events": events, "peak": max(b for _, b in events), "trace": fsdp_trace(prof)}
        if mode == "default":  # unsharded sizes (a DTensor's numel() is its global size)
            full = lambda params: sum(p.numel() * p.element_size() for p in params)  # noqa: E731
            out["layer_bytes"] = full(layers[0].parameters())
            out["root_bytes"] = full(model.parameters()) - full(p for layer in layers for p in layer.parameters())
            out["full_bytes"] = full(model.parameters())
    return out


def part_memory_grads(args, ctx, mesh, parts) -> dict:
    """One AdamW step on the sharded model: bytes held per rank, and the gradients vs one process."""
    out = {}
    model = shard_model(build(args, ctx), mesh)
    optimizer = adamw(model, args)
    loss = model(**my_share(global_batch(args, 0), ctx)).loss
    loss.backward()
    out["loss"] = global_mean(loss.item())
    if "grads" in parts:
        sharded = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # all-gathers: collective
        if ctx.is_main:
            ref = build(args, ctx)  # one process, the whole batch, the same initial weights
            ref_loss = ref(**{k: v.to(ctx.device) for k, v in global_batch(args, 0).items()}).loss
            ref_loss.backward()
            ref_grads = dict(ref.named_parameters())
            diffs = {n: (g - ref_grads[n].grad).abs().max().item() for n, g in sharded.items()}
            num = sum((g.double() ** 2).sum() for g in sharded.values()) ** 0.5
            den = sum((ref_grads[n].grad.double() ** 2).sum() for n in sharded) ** 0.5
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
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.extend(unsharded_dtypes(m)))
    start = time.perf_counter()
    loss = model(**my_share(global_batch(args, 0), ctx)).loss
    loss.backward()
    seconds = time.perf_counter() - start
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    optimizer.step()
    p = next(model.parameters())
    out = {"loss": global_mean(loss.item()), "fwd_bwd_s": seconds, "sharded_param_dtype": str(local(p).dtype),
           "gathered_param_dtype": sorted(set(seen)), "grad_dtype": str(local(p.grad).dtype),
           "optim_dtype": str(local(optimizer.state[p]["exp_avg"]).dtype),
           "per_rank": cl.dist.gather(state_bytes(model, optimizer), ctx)}
    # bf16 vs fp32 gradients (the fp32 run of the same step), on rank 0
    ref = shard_model(build(args, ctx), mesh)
    start = time.perf_counter()
    ref(**my_share(global_batch(args, 0), ctx)).loss.backward()
    out["fp32_fwd_bwd_s"] = time.perf_counter() - start
    ref_grads = {n: p.grad.full_tensor() for n, p in ref.named_parameters()}
    num = sum(((grads[n] - ref_grads[n]).double() ** 2).sum() for n in grads) ** 0.5
    den = sum((g.double() ** 2).sum() for g in ref_grads.values()) ** 0.5
    out["grad_rel_err_vs_fp32"] = (num / den).item()
    return out


def part_offload(args, ctx, mesh, fp32_loss: float | None) -> dict:
    out = {}
    try:  # the default pins host memory for fast copies to the GPU: it needs an accelerator
        model = shard_model(build(args, ctx), mesh, offload_policy=CPUOffloadPolicy())
        model(**my_share(global_batch(args, 0), ctx)).loss.backward()
        out["default_policy"] = "ran"
    except Exception as e:  # noqa: BLE001 (the error is the lesson)
        out["default_policy"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    if dist.is_initialized():
        dist.barrier()
    pin = torch.cuda.is_available()
    base = torch.cuda.memory_allocated() if pin else 0
    model = shard_model(build(args, ctx), mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin))
    optimizer = adamw(model, args)
    loss = model(**my_share(global_batch(args, 0), ctx)).loss
    loss.backward()
    optimizer.step()  # runs on the CPU, where the shards and their gradients live
    p = next(model.parameters())
    out.update(pin_memory=pin, loss=global_mean(loss.item()), param_device=str(local(p).device),
               grad_device=str(local(p.grad).device), per_rank=cl.dist.gather(state_bytes(model, optimizer), ctx),
               device_bytes_after_step=(torch.cuda.memory_allocated() - base) if pin else None,
               loss_diff_vs_no_offload=None if fp32_loss is None else abs(global_mean(loss.item()) - fp32_loss))
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
    batch = global_batch(args, 99)
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


def main() -> None:
    parser = cl.dist.argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--parts", default="all", help=f"comma-separated: {', '.join(PARTS)}, or all")
    parser.add_argument("--out-dir", default="build/fsdp07", help="where checkpoints are written")
    parser.add_argument("--steps", type=int, default=4, help="training steps of the checkpoint/resume demo")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (split over the ranks)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="{}", help="Qwen2 config fields as JSON (default: the tiny model)")
    args = parser.parse_args()
    parts = PARTS if args.parts == "all" else tuple(p.strip() for p in args.parts.split(","))
    try:
        json.loads(args.model)
    except ValueError as e:
        parser.error(f"--model is not JSON ({e}): e.g. '{{\"hidden_size\": 256}}'")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}: choose from {', '.join(PARTS)}")
    if "export" in parts and "dcp" not in parts:
        parser.error("--parts export exports the model resumed from the DCP checkpoint: add dcp")

    if args.steps < 2:
        parser.error(f"--steps {args.steps}: need at least 2 (the checkpoint is saved half-way)")
    ctx = cl.dist.init()
    if args.batch_size % ctx.world_size:
        parser.error(f"--batch-size {args.batch_size} does not split over {ctx.world_size} ranks")
    if not dist.is_initialized():  # one process: FSDP2 still needs a (one-rank) process group
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    out_dir = Path(args.out_dir)
    import psutil
    import transformers  # noqa: F401  (imported here, so that its import time counts as start-up, not as a part)

    startup = time.time() - psutil.Process().create_time()
    result = {"world_size": ctx.world_size, "device": str(ctx.device), "parts": list(parts),
              "seconds": {"startup": startup}}
    for part in parts:
        if part == "export":
            continue  # done inside dcp
        start = time.perf_counter()
        cl.dist.rprint(f"--- {part}", ctx=ctx)
        if part == "timeline":
            result["timeline"] = part_timeline(args, ctx, mesh)
        elif part in ("memory", "grads"):
            if "memory_grads" not in result:
                result["memory_grads"] = part_memory_grads(args, ctx, mesh, parts)
        elif part == "mixed":
            result["mixed"] = part_mixed(args, ctx, mesh)
        elif part == "offload":
            result["offload"] = part_offload(args, ctx, mesh, result.get("memory_grads", {}).get("loss"))
        elif part == "dcp":
            result["dcp"] = part_dcp(args, ctx, mesh, out_dir, export="export" in parts)
        result["seconds"][part] = time.perf_counter() - start
    if ctx.is_main:
        cl.dist.report(result)
    cl.dist.close()


if __name__ == "__main__":
    main()
