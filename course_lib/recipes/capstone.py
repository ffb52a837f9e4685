"""The capstone's grid (chapter 11): the SFT step of `sft.py` under one configuration after another,
measuring what each rank holds and how fast it goes. Runnable on a cluster as it is:

    python capstone.py --model-path M --data-dir D --out-dir runs/grid --configs fp32,bf16,ckpt,accum,lora
    torchrun --nproc-per-node=8 capstone.py --model-path M --data-dir D --out-dir runs/grid \
        --configs ddp,zero1,zero2,zero3,zero3_offload,fsdp2

It takes every flag of `sft.py` (its config extends sft's), plus the grid's own. It runs `sft.train()` once
per configuration inside one process group, so N distributed configurations cost one start-up; each
configuration is a variant of the config (`course_lib.sft.capstone.variant_config`) and its backend is the
recipe's own with a measuring mixin in front (`course_lib.sft.capstone.measured`). Results go to
`<out-dir>/<config>.json`, one file per configuration, with a signature of everything that shaped them; a
configuration whose file has the same signature is skipped unless `--rerun`: the grid resumes where it
stopped. Chapter 11 explains and plots it all; course_lib/sft/capstone.py holds the measuring and the reading.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import course_lib as cl
from course_lib.sft import backends, data as D
from course_lib.sft import capstone as grid
from course_lib.config import ConfigError, opt
from course_lib.recipes import sft


@dataclass
class Config(sft.Config):
    """The capstone's grid (chapter 11): sft.py's step under one configuration after another, measured per rank."""

    chapter = "11"
    configs: str = opt(",".join(grid.GRID), "comma-separated configurations of the grid")
    accum_split: int = opt(4, "micro-batches the accumulation rows split a micro-batch into (same tokens per step)")
    rerun: bool = opt(False, "measure again even where a stored result matches")

    def names(self) -> list[str]:
        return [n.strip() for n in self.configs.split(",") if n.strip()]

    def check(self) -> None:
        super().check()
        try:
            grid.check_names(self.names())
        except ValueError as e:
            raise ConfigError(str(e)) from None


def quiet() -> None:
    """Keep a grid's output readable: no per-call deprecation warnings from DeepSpeed's collectives
    (torch 2.13 warns on every call), no progress bars per configuration."""
    import warnings

    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    try:
        import datasets
        from transformers.utils import logging as hf_logging

        datasets.disable_progress_bars()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def measure_one(name: str, cfg: Config) -> dict:
    """Run sft.train() under configuration `name`; return its measurements (every rank's, on every rank)."""
    variant = grid.variant_config(name, cfg, cfg.accum_split)
    made: list = []

    def factory(c, ctx):  # the recipe's backend, with the measuring mixin in front
        made.append(grid.measured(backends.pick(c, ctx))(c, ctx))
        return made[-1]

    quiet()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        res, error = sft.train(variant, backend_factory=factory), None
    except torch.OutOfMemoryError as e:  # did not fit: record it and go on
        res, error = {}, f"out of memory: {str(e).splitlines()[0]}"
    except Exception as e:  # noqa: BLE001  a configuration this machine cannot run is a finding too
        res, error = {}, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    backend = made[-1] if made else None
    if error and backend is not None and getattr(backend, "model", None) is not None:
        backend.close()  # train() closes it when it returns
    ctx = cl.dist.init()
    has = backend is not None and hasattr(backend, "saved")
    mine = {"states": backend.states if has else None, "saved_per_micro": backend.saved if has else [],
            "weight_copies_per_micro": backend.copies if has else [], "cuda_peak": cl.cuda_peak_bytes(), "error": error,
            "adamw_kernel": getattr(backend, "adamw_kernel", None)}
    ranks = cl.dist.gather(mine, ctx)
    v = grid.GRID[name]
    out = {"config": name, "label": v.label, "ref": v.ref, "ranks": ranks, "world_size": ctx.world_size,
           "wall_seconds": time.perf_counter() - start, "fit": not any(r["error"] for r in ranks),
           "error": next((r["error"] for r in ranks if r["error"]), None)}
    if res:
        out.update({k: res[k] for k in ("backend", "precision", "params", "trainable", "loss", "seconds", "tokens",
                                        "memory", "peak_rss_per_rank") if k in res})  # memory: with --memory-trace (chapter 10)
        # each step's rate after the first (warm-up), median: one step stalled by a busy machine does not count
        timed = range(1, len(res["seconds"])) if len(res["seconds"]) > 1 else range(len(res["seconds"]))
        out["tokens_per_s"] = statistics.median(res["tokens"][i] / res["seconds"][i] for i in timed)
        out["tokens_per_s_overall"] = res["tokens_per_s"]  # sft.py's: all tokens / all time, steps 2..n
        out["micro_batch"], out["accum"] = variant.micro_batch, variant.accum
    del backend
    gc.collect()
    return out


def pending(cfg: Config, ranks: int) -> list[str]:
    """The configurations of `cfg` with no stored result of the same signature (all of them with --rerun)."""
    return [n for n in cfg.names() if cfg.rerun or grid.cached(
        cfg.out_dir, n, grid.signature(n, grid.variant_config(n, cfg, cfg.accum_split), ranks)) is None]


def run(cfg: Config, log=print) -> dict:
    """Measure each configuration of `cfg` (skipping those already stored with the same signature unless
    `cfg.rerun`); return {name: result}. Call it in one process for the single-process rows, or on every
    rank of one launch for the distributed ones."""
    ctx = cl.dist.init()
    todo = set(pending(cfg, ctx.world_size))
    results = {}
    for name in cfg.names():
        sig = grid.signature(name, grid.variant_config(name, cfg, cfg.accum_split), ctx.world_size)
        if name not in todo:
            results[name] = grid.cached(cfg.out_dir, name, sig)
            if ctx.is_main:
                log(f"{name}: stored result reused ({grid.result_path(cfg.out_dir, name)}); --rerun measures again")
            continue
        if grid.GRID[name].distributed and ctx.world_size < 2:
            raise ValueError(f"{name} needs several ranks: launch with torchrun --nproc-per-node=N")
        result = measure_one(name, cfg)
        result["signature"] = sig
        results[name] = result
        if ctx.is_main:
            grid.store(cfg.out_dir, name, result)
            log(f"{name}: {result['error'] or 'ran'}, {result.get('tokens_per_s', float('nan')):,.0f} tokens/s, "
                f"{result['wall_seconds']:.1f} s")
    return results


def rank_reference(P_ranks, work, rerun: bool = False) -> tuple[Config, dict]:
    """Chapter 11 on one GPU, where the distributed rows are CPU ranks at the cpu profile's sizes (`P_ranks`, from
    `cl.presets.ranks_plan`): (their config, {grid.RANK_BASE: their reference row}). The config gets a workspace of
    those sizes under `work` and the ranks' precision (`grid.RANK_PRECISION`); the reference is that config's
    one-process row, measured in this process on the CPU (`cl.env.cpu_only`) on one core, as the cpu profile
    measures its own rows."""
    model_dir, data_dir = D.sft_workspace(Path(work) / "work", None, P_ranks.sft_model, "reverse", P_ranks.n_train, 10,
                                          seed=P_ranks.seed)
    rank_cfg = Config.from_preset(P_ranks, model_path=model_dir, data_dir=data_dir, out_dir=work, pack=True,
                                  rerun=rerun, precision=grid.RANK_PRECISION)
    threads = torch.get_num_threads()  # the cpu profile's rows run on one core (a rank is a core)
    try:
        with cl.env.cpu_only():
            ref = run(cl.config.replace(rank_cfg, configs=grid.RANK_PRECISION))
    finally:
        torch.set_num_threads(threads)
    return rank_cfg, {grid.RANK_BASE: ref[grid.RANK_PRECISION]}


def main(argv=None) -> dict:
    cfg = Config.parse(argv)
    results = run(cfg)
    cl.dist.finish(results)
    return results


if __name__ == "__main__":
    main()
    cl.dist.exit_now()  # (skips the interpreter's teardown: see exit_now)
