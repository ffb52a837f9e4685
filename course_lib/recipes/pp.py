"""Pipeline parallelism: a Qwen2 model in p stages, GPipe over m micro-batches (chapter 08).

One stage per rank, with PyTorch's `torch.distributed.pipelining` (PipelineStage + ScheduleGPipe).
First checked against the unsplit model (logits, loss, every gradient); then, for each m, every
rank timestamps its compute (course_lib.pipeline_parallel.record_compute) and the idle share of
the step, the bubble, is set beside GPipe's (p − 1)/(m + p − 1).

    torchrun --nproc-per-node=2 pp.py --micro-batches 1 2 4 8
    torchrun --nproc-per-node=4 pp.py --num-hidden-layers 24 --hidden-size 896 ... --micro-batches 4 8 16
"""
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import course_lib as cl
from course_lib import pipeline_parallel as ppl


@dataclass
class Config(cl.config.RecipeConfig, cl.config.ModelSize):
    """Pipeline parallelism: a Qwen2 model in p stages, GPipe over m micro-batches (chapter 08)."""

    chapter = "08"
    preset_model = "pp_model"  # deeper than the profile's model, a small vocabulary: balanced stages
    micro_batches: tuple[int, ...] = cl.config.preset("the micro-batch counts m to measure")
    micro_batch: int = cl.config.preset("sequences per micro-batch; a step's batch is m of them")
    repeat: int = cl.config.preset("timed steps per m (after one warm-up); the fastest is kept", knob="pp_repeat")
    seq_len: int = cl.config.preset("tokens per sequence")
    seed: int = cl.config.preset("seed of the model and the data")


def causal_lm_loss(logits, labels):
    """The loss Qwen2ForCausalLM computes: predict token t+1 from the tokens up to t."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def make_schedule(module, ctx, m: int, log: list | None = None):
    stage = PipelineStage(module, ctx.rank, ctx.world_size, ctx.device)
    loss_fn = causal_lm_loss
    if log is not None:
        loss_fn = ppl.record_compute(stage, log, loss_fn)
    return ScheduleGPipe(stage, n_microbatches=m, loss_fn=loss_fn)


def step(schedule, ctx, ids):
    """One GPipe step: the first stage feeds the input, the last gets the targets and the outputs."""
    first, last = ctx.rank == 0, ctx.rank == ctx.world_size - 1
    losses = []
    kwargs = {"target": ids, "losses": losses} if last else {}
    out = schedule.step(ids, **kwargs) if first else schedule.step(**kwargs)
    return out, losses


def equivalence(ctx, args, model, module, batch, m: int) -> dict:
    """Pipelined outputs and gradients vs the unsplit model on the same batch."""
    model.zero_grad()
    ref = model(**batch)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    out, losses = step(make_schedule(module, ctx, m), ctx, batch["input_ids"])
    result = {}
    if ctx.rank == ctx.world_size - 1:
        result["logits_max_diff"] = (out - ref.logits).abs().max().item()
        result["loss"] = torch.stack(losses).mean().item()
        result["loss_unsplit"] = ref.loss.item()
    # Tied embeddings: the first and last stage each hold a copy; sum their gradients.
    grads = {ppl.full_name(n): p.grad for n, p in module.named_parameters()}
    tied = model.config.tie_word_embeddings and ctx.world_size > 1
    if tied and ctx.rank in (0, ctx.world_size - 1):
        key = "model.embed_tokens.weight" if ctx.rank == 0 else "lm_head.weight"
        emb_group = dist.new_group([0, ctx.world_size - 1]) if ctx.world_size > 2 else None
        dist.all_reduce(grads[key], group=emb_group)
        grads["model.embed_tokens.weight"] = grads.pop(key)
    result["grad_max_diff"] = max((g - ref_grads[n]).abs().max().item() for n, g in grads.items())
    result["grads_compared"] = len(grads)
    result["param_bytes_stage"] = sum(p.numel() * p.element_size() for p in module.parameters())
    result["param_bytes_model"] = sum(p.numel() * p.element_size() for p in model.parameters())
    result["layers"] = [int(k) for k in module.layers.keys()]
    return result


def bubble(ctx, args, module, ids, m: int) -> dict:
    """Idle share per rank in the fastest of `--repeats` timed steps (after one warm-up step).

    The fastest step is the one least disturbed by other processes on the machine; every rank
    reports the same step (the step time is common to all ranks).
    """
    log = []
    schedule = make_schedule(module, ctx, m, log)
    runs = []
    for rep in range(args.repeat + 1):
        module.zero_grad()
        log.clear()
        dist.barrier()
        start = time.perf_counter()
        step(schedule, ctx, ids)
        ends = cl.dist.gather(time.perf_counter(), ctx)  # one clock on one machine: the step ends when the last rank does
        end = max(ends)
        if rep == 0:
            continue  # warm-up
        runs.append({"idle": ppl.idle_fraction(log, start, end), "busy_s": sum(e[2] - e[1] for e in log),
                     "cpu_share": ppl.cpu_share(log), "step_s": end - start,
                     "timeline": [(kind, a - start, b - start) for kind, a, b, _ in log]})
    best = min(runs, key=lambda r: r["step_s"])
    return {**best, "idle_all": [r["idle"] for r in runs], "step_all": [r["step_s"] for r in runs]}


def main(argv=None):
    args = Config.parse(argv)
    ctx = cl.dist.init(group_of_one=True)  # one rank too: a group of one, so the same code (meshes, barriers) runs
    model = cl.models.tiny_qwen2(seed=args.seed, **args.size()).to(ctx.device)  # every rank builds the same model...
    module = ppl.qwen2_stage(model, ctx.rank, ctx.world_size)  # ...and keeps one stage of it

    def batch(m):  # m micro-batches of fixed size: each one's work stays well above the transfer cost
        return cl.models.random_batch(args.vocab_size, m * args.micro_batch, args.seq_len, seed=args.seed,
                                      device=ctx.device)

    m_check = max(args.micro_batches)
    check = equivalence(ctx, args, model, module, batch(m_check), m=m_check)
    timings = {m: bubble(ctx, args, module, batch(m)["input_ids"], m) for m in args.micro_batches}
    for m, t in timings.items():
        cl.dist.rprint(f"m={m}: idle {t['idle']:.3f} (formula {ppl.bubble_fraction(ctx.world_size, m):.3f}), "
                       f"step {t['step_s']:.3f} s", ctx=ctx, all_ranks=True)
    per_rank = cl.dist.gather({"check": check, "timings": timings}, ctx)
    if ctx.is_main:
        cl.dist.report({"stages": ctx.world_size, "micro_batches": args.micro_batches, "ranks": per_rank})
    cl.dist.close()


if __name__ == "__main__":
    main()
