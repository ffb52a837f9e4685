"""Pipeline parallelism: a Qwen2 model in p stages, GPipe and 1F1B over m micro-batches (chapter 08).

One stage per rank, with PyTorch's `torch.distributed.pipelining` (PipelineStage + ScheduleGPipe or
Schedule1F1B). First checked against the unsplit model (logits, loss, every gradient); then, for each m
and schedule, every rank timestamps its compute (course_lib.parallel.pipeline_parallel.record_compute): the idle
share of the step, the bubble, is set beside (p − 1)/(m + p − 1); it counts the micro-batches in flight
and the activation bytes it holds (`InFlight`) and the bytes it sends (course_lib.parallel.comm).

    torchrun --nproc-per-node=2 pp.py --micro-batches 1 2 4 8
    torchrun --nproc-per-node=4 pp.py --num-hidden-layers 24 --hidden-size 896 ... --micro-batches 4 8 16
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import course_lib as cl
from course_lib.parallel import pipeline_parallel as ppl


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


SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def make_schedule(module, ctx, m: int, log: list | None = None, kind: str = "gpipe"):
    """A schedule of `kind` over this rank's stage; with `log`, its compute timestamped and its in-flight
    micro-batches and activations counted (the schedule's `.flight`)."""
    stage = PipelineStage(module, ctx.rank, ctx.world_size, ctx.device)
    loss_fn, flight = causal_lm_loss, None
    if log is not None:
        flight = ppl.InFlight(stage)
        loss_fn = ppl.record_compute(stage, log, flight.wrap_loss(loss_fn))
    schedule = SCHEDULES[kind](stage, n_microbatches=m, loss_fn=loss_fn)
    schedule.flight = flight
    return schedule


def step(schedule, ctx, ids):
    """One step of either schedule: the first stage feeds the input, the last gets the targets and the outputs."""
    first, last = ctx.rank == 0, ctx.rank == ctx.world_size - 1
    losses = []
    kwargs = {"target": ids, "losses": losses} if last else {}
    out = schedule.step(ids, **kwargs) if first else schedule.step(**kwargs)
    return out, losses


def equivalence(ctx, args, model, module, batch, m: int) -> dict:
    """Pipelined outputs and gradients vs the unsplit model on the same batch. The reference runs one
    micro-batch at a time (loss / m each, gradients accumulated: the same gradient as the whole batch's mean
    loss), so one micro-batch's logits live at once: a whole batch's, at Qwen's 152k words, are tens of GB."""
    model.zero_grad()
    out, losses = step(make_schedule(module, ctx, m), ctx, batch["input_ids"])
    grads = {ppl.full_name(n): p.grad.clone() for n, p in module.named_parameters()}  # module shares model's params
    model.zero_grad()
    last, worst, ref_losses = ctx.rank == ctx.world_size - 1, 0.0, []
    for i, ids in enumerate(batch["input_ids"].chunk(m)):
        ref = model(input_ids=ids, labels=ids)
        (ref.loss / m).backward()
        ref_losses.append(ref.loss.item())
        if last:
            worst = max(worst, (out.chunk(m)[i] - ref.logits).abs().max().item())
        del ref
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    result = {}
    if last:
        result["logits_max_diff"] = worst
        result["loss"] = torch.stack(losses).mean().item()
        result["loss_unsplit"] = sum(ref_losses) / m  # equal micro-batches: the mean of their means
    # Tied embeddings: the first and last stage each hold a copy; sum their gradients.
    tied = model.config.tie_word_embeddings and ctx.world_size > 1
    emb_group = dist.new_group([0, ctx.world_size - 1]) if tied and ctx.world_size > 2 else None  # every rank calls it
    if tied and ctx.rank in (0, ctx.world_size - 1):
        key = "model.embed_tokens.weight" if ctx.rank == 0 else "lm_head.weight"
        dist.all_reduce(grads[key], group=emb_group)
        grads["model.embed_tokens.weight"] = grads.pop(key)
    result["grad_max_diff"] = max((g - ref_grads[n]).abs().max().item() for n, g in grads.items())
    result["grads_compared"] = len(grads)
    result["param_bytes_stage"] = sum(p.numel() * p.element_size() for p in module.parameters())
    result["param_bytes_model"] = sum(p.numel() * p.element_size() for p in model.parameters())
    result["layers"] = [int(k) for k in module.layers.keys()]
    return result


def bubble(ctx, args, module, ids, m: int, kind: str = "gpipe") -> dict:
    """Idle share per rank in the fastest of `--repeats` timed steps (after one warm-up step).

    The fastest step is the one least disturbed by other processes on the machine; every rank
    reports the same step (the step time is common to all ranks).
    """
    log, runs, comm = [], [], cl.comm.CommCounter()  # comm: the sends of the warm-up step
    schedule = make_schedule(module, ctx, m, log, kind)
    for rep in range(args.repeat + 1):
        module.zero_grad()
        log.clear()
        schedule.flight.reset()
        dist.barrier()
        start = cl.timing.now()
        with comm if rep == 0 else nullcontext():
            step(schedule, ctx, ids)
        ends = cl.dist.gather(cl.timing.now(), ctx)  # one clock on one machine: the step ends when the last rank does
        end = max(ends)
        if rep == 0:
            continue  # warm-up
        runs.append({"idle": ppl.idle_fraction(log, start, end), "busy_s": sum(e[2] - e[1] for e in log),
                     "cpu_share": ppl.cpu_share(log), "step_s": end - start,
                     "timeline": [(what, a - start, b - start) for what, a, b, _ in log],
                     "timeline_cpu_s": [cpu for *_, cpu in log],  # each interval's CPU seconds (thread_time)
                     "peak_micro_batches": schedule.flight.peak_micro_batches,
                     "peak_activation_bytes": schedule.flight.peak_bytes, "comm": comm.summary()})
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
    one_f_one_b = {m: bubble(ctx, args, module, batch(m)["input_ids"], m, "1f1b")
                   for m in args.micro_batches if m >= ctx.world_size}  # 1F1B needs m >= p
    per_rank = cl.dist.gather({"check": check, "timings": timings, "1f1b": one_f_one_b}, ctx)
    cl.dist.finish({"stages": ctx.world_size, "micro_batches": args.micro_batches, "ranks": per_rank,
                    "micro_batch": args.micro_batch, "seq_len": args.seq_len, "hidden_size": args.hidden_size})


if __name__ == "__main__":
    main()
    cl.dist.exit_now()  # (skips the interpreter's teardown: see exit_now)
