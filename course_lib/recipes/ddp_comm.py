"""How much of a DDP step is communication? Chapter 12's provoked communication bottleneck.

    torchrun --nproc-per-node=2 ddp_comm.py --bucket-mb 0.01 25 --steps 20

For each gradient-bucket size, time training steps with DDP's all-reduce on, and the same steps
under `no_sync()` (no communication at all); the difference is the time communication adds. A tiny
model with tiny buckets makes many small all-reduces, each paying the network's latency: the step
becomes communication-bound. Larger buckets (DDP's default is 25 MB) make few large ones.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

import course_lib as cl
from course_lib.parallel.data_parallel import apply_ddp, timed_step


def time_steps(model, optimizer, batch, steps: int) -> tuple[float, float]:
    """Median seconds of one training step with the gradient all-reduce and without it (`no_sync()`). The two
    alternate, step by step, so that whatever else the machine is doing weighs on both alike."""
    times = {True: [], False: []}
    for _ in range(steps):
        for sync in (True, False):
            times[sync].append(timed_step(model, optimizer, batch, sync))
    return statistics.median(times[True]), statistics.median(times[False])


@dataclass
class Config(cl.config.RecipeConfig, cl.config.ModelSize):
    """How much of a DDP step is communication? Chapter 12's provoked communication bottleneck."""

    chapter = "12"
    preset_model = "comm_model"  # a small model: many small gradients, so communication shows
    bucket_mb: tuple[float, ...] = cl.config.opt((0.01, 25.0), "DDP bucket_cap_mb values to compare")
    steps: int = cl.config.preset("timed steps per bucket size (median)", knob="comm_steps")
    micro_batch: int = cl.config.preset("sequences per rank", knob="comm_micro_batch")
    seq_len: int = cl.config.preset("tokens per sequence", knob="comm_seq_len")


def main(argv=None) -> None:
    args = Config.parse(argv)
    ctx = cl.dist.init(group_of_one=True)  # DDP needs a process group, even of one
    batch = cl.models.random_batch(args.vocab_size, args.micro_batch, args.seq_len, seed=ctx.rank, device=ctx.device)
    result = {"world_size": ctx.world_size, "runs": []}
    for cap in args.bucket_mb:
        model = cl.models.tiny_qwen2(**args.size()).to(ctx.device)  # a fresh model: one DDP wrapper per module
        result["params"] = sum(p.numel() for p in model.parameters())
        ddp = apply_ddp(model, ctx.device, bucket_cap_mb=cap)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        time_steps(ddp, optimizer, batch, 2)  # warm-up: DDP builds its buckets on the first steps
        with_comm, without = time_steps(ddp, optimizer, batch, args.steps)
        buckets = ddp._get_ddp_logging_data().get("num_buckets_reduced")
        run = {"bucket_mb": cap, "step_s": with_comm, "step_no_sync_s": without, "buckets": buckets,
               "comm_fraction": max(0.0, (with_comm - without) / with_comm)}
        cl.dist.rprint(f"bucket_cap_mb={cap}: step {with_comm * 1e3:.1f} ms, without sync {without * 1e3:.1f} ms, "
                       f"communication {run['comm_fraction']:.0%} of the step", ctx=ctx)
        result["runs"].append(run)
    cl.dist.finish(result)


if __name__ == "__main__":
    main()
    cl.dist.exit_now()  # (skips the interpreter's teardown: see exit_now)
