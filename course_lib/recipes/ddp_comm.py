"""How much of a DDP step is communication? Chapter 12's provoked communication bottleneck.

    torchrun --nproc-per-node=2 ddp_comm.py --bucket-mb 0.01 25 --steps 20

For each gradient-bucket size, time training steps with DDP's all-reduce on, and the same steps
under `no_sync()` (no communication at all); the difference is the time communication adds. A tiny
model with tiny buckets makes many small all-reduces, each paying the network's latency: the step
becomes communication-bound. Larger buckets (DDP's default is 25 MB) make few large ones.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import course_lib as cl


def time_steps(model, optimizer, batch, steps: int, sync: bool) -> float:
    """Median seconds of one training step, with or without the gradient all-reduce."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        if sync:
            loss = model(**batch).loss
            loss.backward()
        else:
            with model.no_sync():
                loss = model(**batch).loss
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cl.timing.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = cl.dist.argument_parser(__doc__.splitlines()[0])
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[0.01, 25.0], help="DDP bucket_cap_mb values to compare")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    args = p.parse_args()
    ctx = cl.dist.init()
    size = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=4 * args.hidden, vocab_size=512)
    batch = cl.models.random_batch(512, args.batch, args.seq, seed=ctx.rank, device=ctx.device)
    result = {"world_size": ctx.world_size, "runs": []}
    for cap in args.bucket_mb:
        model = cl.models.tiny_qwen2(**size).to(ctx.device)  # a fresh model: one DDP wrapper per module
        result["params"] = sum(p.numel() for p in model.parameters())
        ddp = DDP(model, bucket_cap_mb=cap)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        time_steps(ddp, optimizer, batch, 3, sync=True)  # warm-up: DDP builds its buckets on the first steps
        with_comm = time_steps(ddp, optimizer, batch, args.steps, sync=True)
        without = time_steps(ddp, optimizer, batch, args.steps, sync=False)
        buckets = ddp._get_ddp_logging_data().get("num_buckets_reduced")
        run = {"bucket_mb": cap, "step_s": with_comm, "step_no_sync_s": without, "buckets": buckets,
               "comm_fraction": max(0.0, (with_comm - without) / with_comm)}
        cl.dist.rprint(f"bucket_cap_mb={cap}: step {with_comm * 1e3:.1f} ms, without sync {without * 1e3:.1f} ms, "
                       f"communication {run['comm_fraction']:.0%} of the step", ctx=ctx)
        result["runs"].append(run)
    if ctx.is_main:
        cl.dist.report(result)
    cl.dist.close()


if __name__ == "__main__":
    main()
