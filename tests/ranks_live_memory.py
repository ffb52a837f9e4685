"""Launched by tests/test_live_memory.py on 2 ranks: one training step of a tiny Qwen2 under DDP, FSDP2,
DeepSpeed ZeRO-2 or ZeRO-3, tracked by cl.LiveTensorBytes on every rank; reports what each rank measured
beside the model state walked independently (DeepSpeed: course_lib.parallel.zero.held_bytes; FSDP2: local shards)."""
import argparse
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # DeepSpeed imports torch.compile'd helpers; keep start-up short

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import course_lib as cl  # noqa: E402

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
             vocab_size=128)

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--backend", choices=["ddp", "fsdp2", "zero2", "zero3"], required=True)
args = parser.parse_args()
ctx = cl.dist.init(group_of_one=True)
torch.manual_seed(0)
model = cl.models.tiny_qwen2(**SMALL)
full_param_bytes = cl.tensor_bytes(model.parameters())
batch = cl.models.random_batch(SMALL["vocab_size"], 2, 16, seed=ctx.rank)


def local_bytes(tensors) -> int:
    from course_lib.memory.live_memory import plain_tensors

    return cl.tensor_bytes(p for t in tensors for p in plain_tensors(t))


if args.backend.startswith("zero"):
    import deepspeed

    from course_lib.parallel import zero

    zero.no_jit()
    config = zero.prepare(args.backend, ctx.world_size, micro_batch=2, accum_steps=1, hidden_size=SMALL["hidden_size"],
                          lr=1e-3, precision="fp32", persistence_threshold=0)
    config["zero_optimization"]["reduce_bucket_size"] = 4096
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    tracked, optimizer = engine, None

    def step():
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()

    def state():
        return zero.held_bytes(engine)["total"], zero.held_bytes(engine)["params"]

    def bucket() -> int:
        """ZeRO-3's reduce bucket: a buffer of reduce_bucket_size elements made in the first backward and kept,
        that gradients pass through on their way to the partition; live memory, not model state (held_bytes)."""
        if args.backend != "zero3":  # ZeRO-2's bucket is counted among its gradient buffers
            return 0
        return sum(b.buffer.untyped_storage().nbytes() for b in engine.optimizer.ipg_buckets.values()
                   if b.buffer is not None)
else:
    if args.backend == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (ctx.world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracked = model

    def step():
        logits = model(input_ids=batch["input_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        del logits
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def bucket() -> int:
        return 0

    def state():
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        params = local_bytes(model.parameters())
        return params + local_bytes(grads) + local_bytes(states), params

step()  # buffers, optimizer state and DeepSpeed's partitions exist from here
step()  # DDP rebuilds its gradient buckets in the second step: the third one is steady
state_before, _ = state()
mem = cl.LiveTensorBytes(tracked, optimizer)
with mem:
    mem.mark("step")
    step()
state_after, _ = state()
at_peak, start = mem.peak_by_category(), mem.timeline()
ranks = cl.dist.gather(dict(rank=ctx.rank, baseline=start["total"][0] - start["inputs"][0], state_before=state_before,
                            baseline_params=start["parameters"][0], peak=mem.peak, at_peak_sum=sum(at_peak.values()),
                            activations_at_peak=at_peak["activations"], now_end=mem.now - mem.now_by_category()["inputs"],
                            state_after=state_after, bucket=bucket(),
                            full_param_bytes=full_param_bytes, at_peak=at_peak, at_end=mem.now_by_category(),
                            at_start={c: start[c][0] for c in mem.categories()},
                            held=zero.held_bytes(engine) if args.backend.startswith("zero") else None), ctx)
if ctx.is_main:
    cl.dist.report({"ranks": ranks})
if args.backend.startswith("zero"):
    engine.destroy()  # DeepSpeed's hooks and partitions released before the process group goes, as the recipe does
cl.dist.close()
cl.dist.exit_now()
