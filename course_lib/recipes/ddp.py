"""Data parallelism, checked against one process: by hand, with hooks, and with DDP (chapter 05).

    torchrun --nproc-per-node=2 course_lib/recipes/ddp.py --steps 5 --micro-batch 4 --seq-len 64

Every rank builds the same tiny Qwen2 and reads its own shard of the data (DistributedSampler).
Each rank also gathers every rank's batch, so it can take the step ONE process would take on
the concatenated (global) batch, and compare. In one run it measures:

1. the sampler: which samples each rank reads, and its padding;
2. one SGD step three ways (all-reduce by hand, per-parameter hooks, DDP) vs one process;
3. several DDP steps (SGD, then AdamW) vs one process, and whether the ranks stay identical;
4. gradient accumulation: with and without `no_sync()`, the all-reduce calls and the result;
5. DDP's buckets and when each is sent, relative to backward;
6. step time: one rank alone, all ranks with DDP, and all ranks with DDP under no_sync() (weak scaling:
   same batch per rank), interleaved;
7. communication (course_lib.parallel.comm): the bytes one DDP step sends, counted at the process group (and what a
   default DDP sends besides: its buffers); an α + β·bytes fit per collective from a message-size sweep, beside the
   step's own calls timed one by one; and, per bucket size and `gradient_as_bucket_view`, the buckets and the gradient
   memory.

The timed DDPs of parts 6 and 7 are built with buffer sync off (NO_BUFFER_SYNC): they send the gradients only.

Rank 0 reports everything as one JSON result (`cl.dist.report`).
"""
from __future__ import annotations

import copy
import inspect
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import course_lib as cl
from course_lib.parallel.data_parallel import (CommLog, DataParallelNaive, allreduce_gradients, apply_ddp,
                                               gradient_bytes, timed_step)


@dataclass
class Config(cl.config.RecipeConfig, cl.config.ModelSize):
    """Data parallelism, checked against one process: by hand, with hooks, and with DDP (chapter 05)."""

    chapter = "05"
    steps: int = cl.config.preset("DDP steps compared with one process")
    micro_batch: int = cl.config.preset("sequences per rank per micro-batch")
    seq_len: int = cl.config.preset("tokens per sequence")
    accum: int = cl.config.preset("micro-batches per optimizer step (the accumulation part)")
    bucket_mb: float = cl.config.preset("a small DDP bucket cap, to see several buckets")
    repeat: int = cl.config.preset("timed steps (median) for the step-time part")
    lr: float = cl.config.opt(0.1, "SGD learning rate")
    adamw_lr: float = cl.config.opt(1e-3, "AdamW learning rate")
    seed: int = cl.config.preset("seed of the model and the data")
    sweep_sizes: tuple[int, ...] = cl.config.preset("message sizes (bytes) of the collective-cost sweep")
    sweep_repeat: int = cl.config.preset("timed calls per collective and size (median)")
    comm_buckets: tuple[float, ...] = cl.config.preset("bucket_cap_mb values for the exposed-communication part")
    comm_repeat: int = cl.config.preset("steps whose all-reduces are timed one by one, beside the α + β fit")


# The rotary tables are buffers that never change: no need for DDP to broadcast them before every forward, as a
# default DDP does (torch 2.13 renamed the flag `forward_sync_buffers`). Every timed DDP below is built with this.
NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                  else {"broadcast_buffers": False})


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest absolute difference between two models' parameters."""
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


def global_batch(local: torch.Tensor) -> torch.Tensor:
    """Every rank's batch, concatenated in rank order: what one process would train on."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts)


def lm(ids: torch.Tensor) -> dict:
    return {"input_ids": ids, "labels": ids}


def sync_gap(model: torch.nn.Module) -> float:
    """Largest difference between this rank's parameters and rank 0's (0.0: bitwise identical)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    gap = (flat - ref).abs().max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return gap.item()


def main(argv=None):
    args = Config.parse(argv)
    ctx = cl.dist.init(group_of_one=True)  # DDP needs a process group, even of one
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    out: dict = {"world_size": world, "threads_per_rank": torch.get_num_threads()}
    base = cl.models.tiny_qwen2(**args.size(), seed=args.seed).to(dev)
    vocab = base.config.vocab_size
    out["params"] = sum(p.numel() for p in base.parameters())

    # 1. DistributedSampler: each rank reads its own shard; the shards cover the data once per epoch.
    n = world * args.micro_batch * args.accum * (args.steps + 1)
    data = TensorDataset(torch.randint(0, vocab, (n, args.seq_len), generator=torch.Generator().manual_seed(args.seed)))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, drop_last=True)
    shards = [cl.dist.gather(list(sampler), ctx)]
    sampler.set_epoch(1)
    shards.append(cl.dist.gather(list(sampler), ctx))
    sampler.set_epoch(0)
    odd = list(DistributedSampler(range(2 * world + 1), num_replicas=world, rank=rank, shuffle=False))
    out["sampler"] = {"dataset": n, "epoch0": shards[0], "epoch1": shards[1],
                      "odd_dataset": 2 * world + 1, "odd_shards": cl.dist.gather(odd, ctx)}
    batches = [b[0].to(dev) for b in loader]
    cl.dist.rprint(f"sampler: {n} samples, {len(batches)} micro-batches of {args.micro_batch} per rank", ctx=ctx)

    # 2. One SGD step, three ways, against one process on the concatenated batch.
    local, full = batches[0], global_batch(batches[0])
    reference = copy.deepcopy(base)
    opt = torch.optim.SGD(reference.parameters(), lr=args.lr)
    reference(**lm(full)).loss.backward()
    opt.step()

    by_hand = copy.deepcopy(base)
    opt = torch.optim.SGD(by_hand.parameters(), lr=args.lr)
    by_hand(**lm(local)).loss.backward()
    allreduce_gradients(by_hand)  # the whole idea of data parallelism, in one call
    opt.step()

    hooked = DataParallelNaive(copy.deepcopy(base))
    opt = torch.optim.SGD(hooked.parameters(), lr=args.lr)
    hooked(**lm(local)).loss.backward()  # the hooks averaged each gradient during backward
    opt.step()

    ddp = apply_ddp(copy.deepcopy(base), ctx.device)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    ddp(**lm(local)).loss.backward()
    opt.step()
    out["one_step_diff"] = cl.dist.gather({"by_hand": max_diff(by_hand, reference),
                                           "hooks": max_diff(hooked.module, reference),
                                           "ddp": max_diff(ddp.module, reference),
                                           "moved": max_diff(reference, base)}, ctx)
    cl.dist.rprint("one step vs one process: " + ", ".join(f"{k} {v:.1e}" for k, v in out["one_step_diff"][0].items()),
                   ctx=ctx)
    del by_hand, hooked

    # 3. Several steps: DDP vs one process (SGD, then AdamW), and the ranks' parameters vs rank 0's.
    for name, make_opt in (("sgd", lambda ps: torch.optim.SGD(ps, lr=args.lr)),
                           ("adamw", lambda ps: torch.optim.AdamW(ps, lr=args.adamw_lr))):
        ddp, reference = apply_ddp(copy.deepcopy(base), ctx.device), copy.deepcopy(base)
        opt_d, opt_r = make_opt(ddp.parameters()), make_opt(reference.parameters())
        diffs, losses = [], []
        for ids in batches[:args.steps]:
            loss = ddp(**lm(ids)).loss
            loss.backward()
            opt_d.step(); opt_d.zero_grad()
            full_loss = reference(**lm(global_batch(ids))).loss
            full_loss.backward()
            opt_r.step(); opt_r.zero_grad()
            diffs.append(max_diff(ddp.module, reference))
            losses.append(full_loss.item())
        out[f"{name}_steps"] = {"diff": cl.dist.gather(diffs, ctx), "loss": losses, "sync_gap": sync_gap(ddp.module)}
        cl.dist.rprint(f"{args.steps} {name} steps: DDP vs one process {max(diffs):.2e}, "
                       f"ranks vs rank 0 {out[f'{name}_steps']['sync_gap']:.1e}", ctx=ctx)

    # 4. Gradient accumulation: `accum` micro-batches per step, with and without no_sync().
    micro = batches[:args.accum]
    reference = copy.deepcopy(base)
    opt = torch.optim.SGD(reference.parameters(), lr=args.lr)
    reference(**lm(torch.cat([global_batch(ids) for ids in micro]))).loss.backward()
    opt.step()
    accum = {}
    for use_no_sync in (False, True):
        ddp, log = apply_ddp(copy.deepcopy(base), ctx.device), CommLog()
        ddp.register_comm_hook(None, log.hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
        for i, ids in enumerate(micro):
            skip = use_no_sync and i < len(micro) - 1
            with ddp.no_sync() if skip else nullcontext():
                (ddp(**lm(ids)).loss / len(micro)).backward()
        opt.step()
        accum["no_sync" if use_no_sync else "sync_every"] = {
            "allreduce_calls": len(log.calls), "elements_sent": sum(c["numel"] for c in log.calls),
            "diff": max_diff(ddp.module, reference)}
    out["accumulation"] = {"micro_batches": len(micro), **accum}
    cl.dist.rprint("accumulation: " + ", ".join(f"{k} {v['allreduce_calls']} all-reduce(s)" for k, v in accum.items()),
                   ctx=ctx)

    # 5. Buckets and overlap: when each bucket's all-reduce starts, relative to backward.
    buckets = {}
    for cap in (args.bucket_mb, 25.0):  # 25 MiB is DDP's default (its bucket_cap_mb counts MiB)
        clock = cl.timing.Clock(dev)  # CUDA events on a GPU: host clocks there would time launches, not work
        ddp, log = apply_ddp(copy.deepcopy(base), ctx.device, bucket_cap_mb=cap), CommLog(clock)
        ddp.register_comm_hook(None, log.hook)
        first_param = next(ddp.module.parameters())  # the embedding: its gradient is complete last
        ready = {}
        first_param.register_post_accumulate_grad_hook(lambda p: ready.__setitem__("t", clock.mark()))
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
        for ids in batches[:3]:  # DDP rebuilds its buckets after the first step, in the order gradients arrived
            log.clear()
            loss = ddp(**lm(ids)).loss
            t0 = clock.mark()
            loss.backward()
            t1 = clock.mark()
            opt.step(); opt.zero_grad()
        ms = lambda a, b: 1e3 * clock.seconds(a, b)  # noqa: E731
        buckets[str(cap)] = {"cap_mb": cap, "sizes": [c["numel"] for c in log.calls],
                             "launch_ms": [ms(t0, c["t"]) for c in log.calls], "done_ms": [ms(t0, c["done"]) for c in log.calls],
                             "last_grad_ms": ms(t0, ready["t"]), "backward_ms": ms(t0, t1)}
    out["buckets"] = buckets
    cl.dist.rprint("buckets: " + ", ".join(f"{len(v['sizes'])} at {k} MiB" for k, v in buckets.items()), ctx=ctx)

    # 6. Step time (weak scaling): rank 0 alone (the others wait), every rank with DDP, and every rank with the same
    #    DDP under no_sync() (the same compute, nothing sent), interleaved so that all three see the same background
    #    load; medians over `repeat` steps after one warm-up. The DDP is built as part 7's are (NO_BUFFER_SYNC, DDP's
    #    default bucket caps), and every step is timed_step's (as part 7 times them).
    alone, ddp = copy.deepcopy(base), apply_ddp(copy.deepcopy(base), ctx.device, **NO_BUFFER_SYNC)
    opt_alone, opt_ddp = (torch.optim.SGD(m.parameters(), lr=args.lr) for m in (alone, ddp))
    single, together, quiet = [], [], []
    for i in range(args.repeat + 1):
        ids = batches[i % len(batches)]
        if rank == 0:
            single.append(timed_step(alone, opt_alone, lm(ids)))
        dist.barrier()
        together.append(timed_step(ddp, opt_ddp, lm(ids)))
        dist.barrier()
        quiet.append(timed_step(ddp, opt_ddp, lm(ids), sync=False))
        dist.barrier()
    # a step ends when the slowest rank ends
    together, quiet = ([max(ts) for ts in zip(*cl.dist.gather(x[1:], ctx))] for x in (together, quiet))
    grads = torch.zeros(out["params"], device=dev)
    comm = []
    for _ in range(args.repeat + 1):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(grads)
        cl.timing.synchronize(dev)
        comm.append(time.perf_counter() - t)
    out["timing"] = {"tokens_per_rank_step": args.micro_batch * args.seq_len,  # seconds of each timed step, in turn
                     "one_rank_s": single[1:] if rank == 0 else None, "ddp_s": together, "no_sync_s": quiet,
                     "allreduce_s": comm[1:]}
    cl.dist.rprint(f"timing: DDP step {statistics.median(together) * 1e3:.0f} ms (median)", ctx=ctx)

    # 7. Communication: counted, costed, and how much of it backward hides.
    out["comm"] = communication(args, ctx, base, batches)
    c = out["comm"]
    cl.dist.rprint(f"communication: {c['bytes']:,.0f} B a step, {statistics.median(c['seconds']) * 1e3:.2f} ms "
                   f"(median), {c['predicted_s'] * 1e3:.2f} ms predicted", ctx=ctx)

    cl.dist.finish(out)


def communication(args, ctx, base, batches) -> dict:
    """Part 7: what a DDP step sends (CommCounter), what each collective costs here (sweep, α + β fit) beside the
    step's own calls, timed one by one; for each bucket cap and gradient_as_bucket_view, the buckets and the gradient
    bytes."""
    points, fits = cl.comm.sweep(args.sweep_sizes, repeat=args.sweep_repeat, device=ctx.device)
    ddp = apply_ddp(copy.deepcopy(base), ctx.device, **NO_BUFFER_SYNC)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    for ids in batches[:2]:  # DDP rebuilds its buckets after the first step
        timed_step(ddp, opt, lm(ids))
    with cl.comm.CommCounter() as counted:
        timed_step(ddp, opt, lm(batches[0]))
    serial = []  # each all-reduce started after a barrier and waited for at once: the calls alone, no overlap
    for _ in range(args.comm_repeat):
        with cl.comm.CommCounter(timed=True) as timed:
            timed_step(ddp, opt, lm(batches[0]))
        serial.append(timed.seconds())
    plain = apply_ddp(copy.deepcopy(base), ctx.device)  # DDP's defaults: rank 0's buffers sent before every forward
    popt = torch.optim.SGD(plain.parameters(), lr=args.lr)
    for ids in batches[:2]:
        timed_step(plain, popt, lm(ids))
    with cl.comm.CommCounter() as counted_plain:
        timed_step(plain, popt, lm(batches[0]))
    default_ddp = {"calls": [(c.kind, c.payload) for c in counted_plain.calls],
                   "buffers": {name: b.numel() * b.element_size() for name, b in base.named_buffers()}}
    del plain, popt
    variants = []
    for cap in args.comm_buckets:
        for view in (False, True):
            probe, log = apply_ddp(copy.deepcopy(base), ctx.device, bucket_cap_mb=cap, gradient_as_bucket_view=view,
                                   **NO_BUFFER_SYNC), CommLog()
            probe.register_comm_hook(None, log.hook)
            popt = torch.optim.SGD(probe.parameters(), lr=args.lr)
            for ids in batches[:3]:  # the third step's buckets: rebuilt in the order the gradients arrived
                log.clear()
                timed_step(probe, popt, lm(ids))
            sizes = [4 * c["numel"] for c in log.calls]  # fp32 bytes per bucket, in the order they were sent
            variants.append({"cap_mb": cap, "view": view, "bucket_bytes": sizes, "memory": gradient_bytes(probe.module, log),
                             "predicted_s": cl.comm.predict_seconds(
                                 [{"kind": "all_reduce", "payload": b} for b in sizes], fits),
                             "predicted_last_bucket_s": cl.comm.predict_seconds(
                                 [{"kind": "all_reduce", "payload": sizes[-1]}], fits)})
    return {"points": points, "fits": fits, "summary": counted.summary(), "bytes": counted.total(),
            "calls": len(counted.calls), "payloads": [c.payload for c in counted.calls],  # bytes, in the order sent
            "seconds": serial, "predicted_s": cl.comm.predict_seconds(counted.calls, fits), "variants": variants,
            "default_ddp": default_ddp}


if __name__ == "__main__":
    main()
    cl.dist.exit_now()  # (skips the interpreter's teardown: see exit_now)
