"""The capstone's grid (chapter 11): the SFT step of `sft.py` under one configuration after another,
measuring what each rank holds and how fast it goes. Runnable on a cluster as it is:

    python capstone.py --model-path M --data-dir D --out-dir runs/grid --configs fp32,bf16,ckpt,accum,lora
    torchrun --nproc-per-node=8 capstone.py --model-path M --data-dir D --out-dir runs/grid \
        --configs ddp,zero1,zero2,zero3,zero3_offload,fsdp2

Every flag it does not know goes to `sft.py` unchanged (`--steps`, `--micro-batch`, `--seq-len`, `--pack`,
`--precision`, ...). It runs `sft.py`'s own `train()` (loaded by path, not copied) once per configuration
inside one process group, so N distributed configurations cost one start-up. The only difference is the
`Backend` it hands to `train()`: a subclass that measures, during the first optimizer step (which `sft.py`
leaves out of tokens/s), per rank:

- model states: the parameter, gradient and optimizer-state bytes this rank holds (FSDP2: the local
  shards of its DTensors; DeepSpeed: `course_lib.zero.held_bytes` and `GradPeak`), and which of them
  DeepSpeed offloaded to the host tier;
- saved activations: the bytes autograd keeps for backward in each micro-batch's forward
  (`cl.SavedTensors`; parameters left out, wherever FSDP2 or ZeRO-3 gathered them; autocast's 16-bit
  weight copies counted apart);
- on a GPU, the peak bytes allocated;
- tokens/s: the median of the per-step rates after the first step (and sft.py's overall figure).

Results go to `<out-dir>/<config>.json`, one file per configuration, with a signature of everything
that shaped them (sizes, flags, ranks, hardware). A configuration whose file has the same signature is
skipped unless `--rerun`: the grid resumes where it stopped. Chapter 11 explains and plots it all.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import course_lib as cl
import course_lib.zero  # noqa: F401  (cl.zero: DeepSpeed's per-rank walker)

SFT_PATH = Path(__file__).resolve().parent / "sft.py"
SCHEMA = 3  # what a stored result contains; raise it when the measuring changes, and stored results are redone
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Config:
    label: str                  # how the table names it
    flags: tuple = ()           # sft.py flags it adds
    distributed: bool = False   # needs several ranks (one launch for all of them)
    ref: str | None = None      # the configuration it changes one thing of (for the ranking)
    accum: bool = False         # split the micro-batch into --accum-k micro-batches (same tokens per step)
    lora: bool = False          # train LoRA adapters only
    keep_precision: bool = False  # its flags set the precision itself (fp32 / bf16 rows)
    combination: bool = False   # adds a factor on top of another technique (ranked after the single factors)


# The grid: baseline, one factor at a time, then the distributed ones against DDP (seed 003 §8's method).
# "base" is the precision row the measurements chose (the notebook passes --precision for the rest).
GRID = {
    "fp32": Config("fp32 baseline", ("--precision", "fp32"), keep_precision=True),
    "bf16": Config("+ bf16 autocast", ("--precision", "bf16"), ref="fp32", keep_precision=True),
    "ckpt": Config("+ activation checkpointing", ("--act-ckpt",), ref="base"),
    "accum": Config("+ gradient accumulation", (), ref="base", accum=True),
    "ckpt_accum": Config("+ checkpointing + accumulation", ("--act-ckpt",), ref="ckpt", accum=True, combination=True),
    "lora": Config("LoRA adapters", (), ref="base", lora=True),
    "ddp": Config("DDP", (), distributed=True, ref="base"),
    "zero1": Config("ZeRO-1", ("--deepspeed", "zero1"), distributed=True, ref="ddp"),
    "zero2": Config("ZeRO-2", ("--deepspeed", "zero2"), distributed=True, ref="ddp"),
    "zero2_ckpt": Config("ZeRO-2 + checkpointing", ("--deepspeed", "zero2", "--act-ckpt"), distributed=True,
                         ref="zero2", combination=True),
    "zero3": Config("ZeRO-3", ("--deepspeed", "zero3"), distributed=True, ref="ddp"),
    "zero3_offload": Config("ZeRO-3 + offload", ("--deepspeed", "zero3_offload"), distributed=True, ref="zero3",
                            combination=True),
    "fsdp2": Config("FSDP2", ("--fsdp",), distributed=True, ref="ddp"),
}
SINGLE = [n for n, c in GRID.items() if not c.distributed]
DISTRIBUTED = [n for n, c in GRID.items() if c.distributed]


def load_sft():
    """A private copy of sft.py as a module (loaded by path: the recipe directory is not a package
    on a cluster node). Swapping its `Backend` below touches this copy only."""
    spec = importlib.util.spec_from_file_location("capstone_sft", SFT_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- measuring -----------------------------------------------------------------------------------
def local(t):
    """The part of `t` this rank holds: a DTensor's local shard (FSDP2), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_bytes(tensors) -> int:
    return cl.tensor_bytes(local(t) for t in tensors if t is not None)


class SavedActivations(cl.SavedTensors):
    """`cl.SavedTensors` that looks the parameters up when a tensor is saved, not once at the start:
    FSDP2 and ZeRO-3 swap full weights in and out during the forward, at addresses the parameters did
    not have before (FSDP2's shards are DTensors: their local tensors are looked at). What shares a
    parameter's storage (a weight, its transpose) counts under model states, not here. Autocast's
    16-bit copies of trainable weights (a cast whose input is a parameter) are counted apart, in
    `copies`: they are saved for backward, but their size follows the model, not the batch."""

    def __init__(self, module: torch.nn.Module):
        super().__init__(model=None)
        self.module = module
        self.copies, self._copy_ptrs = 0, set()

    def _is_parameter(self, t) -> bool:
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            return True
        ptr = t.untyped_storage().data_ptr()
        return any(local(p).untyped_storage().data_ptr() == ptr for p in self.module.parameters())

    VIEWS = ("TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
             "ExpandBackward0")

    @classmethod
    def _is_weight_copy(cls, t) -> bool:
        """A cast of a parameter, possibly seen through a view (a linear saves its weight transposed)."""
        fn = t.grad_fn
        while fn is not None and fn.name() in cls.VIEWS:
            fn = fn.next_functions[0][0]
        if fn is None or fn.name() != "ToCopyBackward0":
            return False
        source = fn.next_functions[0][0]
        return isinstance(getattr(source, "variable", None), torch.nn.Parameter)

    def _pack(self, t):
        if self._is_parameter(t):
            return t
        if self._is_weight_copy(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._copy_ptrs:
                self._copy_ptrs.add(ptr)
                self.copies += t.untyped_storage().nbytes()
            return t
        return super()._pack(t)


def apply_lora(model, r: int):
    """LoRA (chapter 09) on the seven projections: the base weights frozen, adapters A, B trained."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                            task_type="CAUSAL_LM"))


def measuring_backend(base: type, sink: list) -> type:
    """A subclass of sft.py's `Backend` that measures during the first optimizer step and appends itself to `sink`."""

    class MeasuredBackend(base):
        def __init__(self, model, args, ctx, bf16):
            if getattr(args, "lora_r", 0):
                model = apply_lora(model, args.lora_r)
            super().__init__(model, args, ctx, bf16)
            self.saved, self.copies, self.states, self._open = [], [], None, None
            self.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            self._hooks = [self.model.register_forward_pre_hook(self._enter),
                           self.model.register_forward_hook(self._exit)]
            self._grad_peak = cl.zero.GradPeak(self.engine) if self.kind == "deepspeed" else None
            sink.append(self)

        def _enter(self, *_):
            self._open = SavedActivations(self.module)
            self._open.__enter__()

        def _exit(self, *_):
            self._open.__exit__(None, None, None)
            self.saved.append(self._open.bytes)
            self.copies.append(self._open.copies)
            self._open = None

        def step(self) -> float:
            if self.states is not None:
                return super().step()
            # the first step: gradients are all there now (torch backends; DeepSpeed's peak was sampled)
            grads = (self._grad_peak.bytes.get("backward", 0) if self._grad_peak
                     else local_bytes(p.grad for p in self.module.parameters()))
            norm = super().step()
            if self.kind == "deepspeed":  # after the step: the optimizer state exists
                held = cl.zero.held_bytes(self.engine)
                states = {"params": held["params"], "grads": grads, "optimizer": held["optimizer"],
                          "host": held["host"]}
                self._grad_peak.remove()
            else:
                opt = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
                states = {"params": local_bytes(self.module.parameters()), "grads": grads,
                          "optimizer": local_bytes(opt), "host": 0}
            states["total"] = states["params"] + states["grads"] + states["optimizer"]
            self.states = states
            for h in self._hooks:  # measured once: the later, timed steps run without hooks
                h.remove()
            return norm

        def save(self, path, meta):  # the grid measures; it keeps no checkpoints
            pass

        def close(self) -> None:
            if self.kind == "deepspeed":
                self.engine.destroy()

    return MeasuredBackend


# --- one configuration ---------------------------------------------------------------------------
def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else None


def signature(name: str, argv: list[str], ranks: int, lora_r: int, accum_k: int) -> dict:
    """Everything that shapes a configuration's numbers; a stored result is reused only if it matches:
    the flags, ranks, hardware, and the contents of the model's config.json and of the training data
    (a directory rewritten with another model shape or task keeps its path, not its digest)."""
    info = cl.hardware_report(show=False)
    argv = [str(a) for a in argv]
    files = {}
    for flag, name_in_dir in (("--model-path", "config.json"), ("--data-dir", "train.jsonl")):
        if flag in argv:
            files[name_in_dir] = _digest(Path(argv[argv.index(flag) + 1]) / name_in_dir)
    return {"schema": SCHEMA, "config": name, "argv": argv, "files": files, "ranks": ranks, "lora_r": lora_r,
            "accum_k": accum_k if GRID[name].accum else 1,
            "hardware": {k: info.get(k) for k in ("cpu", "cpu_cores", "gpu", "torch", "deepspeed")},
            "host": platform.node()}


def config_argv(name: str, common: list[str], accum_k: int) -> list[str]:
    """sft.py's command line for configuration `name`: the common flags plus its own."""
    cfg, argv = GRID[name], [str(a) for a in common]
    if cfg.keep_precision and "--precision" in argv:  # fp32 / bf16 rows set the precision themselves
        i = argv.index("--precision")
        argv = argv[:i] + argv[i + 2:]
    if cfg.accum:
        i = argv.index("--micro-batch")
        micro = int(argv[i + 1])
        if micro % accum_k:
            raise ValueError(f"--micro-batch {micro} must be a multiple of --accum-k {accum_k}")
        argv[i + 1] = str(micro // accum_k)
        argv += ["--accum", str(accum_k)]
    return argv + list(cfg.flags)


def result_path(out_dir, name: str) -> Path:
    return Path(out_dir) / f"{name}.json"


def cached(out_dir, name: str, sig: dict) -> dict | None:
    """The stored result of `name` if it was measured with the same signature, else None."""
    path = result_path(out_dir, name)
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return result if result.get("signature") == sig else None


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


def measure_one(sft, name: str, argv: list[str], lora_r: int, out_dir: Path) -> dict:
    """Run sft.train() under configuration `name`; return its measurements (every rank's, on every rank)."""
    args = sft.parse_args(argv + ["--out-dir", str(out_dir / "runs" / name), "--eval-n", "0", "--no-export",
                                  "--no-progress"])
    args.lora_r = lora_r if GRID[name].lora else 0
    sink: list = []
    quiet()
    sft.Backend = measuring_backend(sft.PlainBackend, sink)  # train() looks `Backend` up when it runs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        res = sft.train(args)
        error = None
    except torch.OutOfMemoryError as e:  # did not fit: record it and go on
        res, error = {}, f"out of memory: {str(e).splitlines()[0]}"
    except Exception as e:  # noqa: BLE001  a configuration this machine cannot run is a finding too
        res, error = {}, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    backend = sink[-1] if sink else None
    ctx = cl.dist.init()
    mine = {"states": backend.states if backend else None,
            "saved_per_micro": backend.saved if backend else [],
            "weight_copies_per_micro": backend.copies if backend else [],
            "cuda_peak": cl.cuda_peak_bytes(), "error": error}
    ranks = cl.dist.gather(mine, ctx)
    out = {"config": name, "label": GRID[name].label, "ref": GRID[name].ref, "ranks": ranks,
           "world_size": ctx.world_size, "wall_seconds": time.perf_counter() - start,
           "fit": not any(r["error"] for r in ranks), "error": next((r["error"] for r in ranks if r["error"]), None)}
    if res:
        out.update({k: res[k] for k in ("backend", "precision", "params", "loss", "seconds", "tokens")})
        # each step's rate after the first (warm-up), median: one step stalled by a busy machine does not count
        timed = range(1, len(res["seconds"])) if len(res["seconds"]) > 1 else range(len(res["seconds"]))
        out["tokens_per_s"] = statistics.median(res["tokens"][i] / res["seconds"][i] for i in timed)
        out["tokens_per_s_overall"] = res["tokens_per_s"]  # sft.py's: all tokens / all time, steps 2..n
        out["trainable"] = backend.trainable
        out["micro_batch"], out["accum"] = args.micro_batch, args.accum
    if backend:
        backend.close()
    del backend, sink
    gc.collect()
    return out


def run(names: list[str], common: list[str], out_dir, *, lora_r: int = 8, accum_k: int = 4,
        rerun: bool = False, log=print) -> dict:
    """Measure each configuration in `names` (skipping those already stored with the same signature
    unless `rerun`); return {name: result}. Call it in one process for the single-process rows, or on
    every rank of one launch for the distributed ones."""
    unknown = [n for n in names if n not in GRID]
    if unknown:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown)}: choose from {', '.join(GRID)}")
    out_dir = Path(out_dir)
    ctx = cl.dist.init()
    sft = load_sft()
    sft.PlainBackend = sft.Backend
    results = {}
    for name in names:
        argv = config_argv(name, common, accum_k)
        sig = signature(name, argv, ctx.world_size, lora_r, accum_k)
        hit = None if rerun else cached(out_dir, name, sig)
        if hit is not None:
            results[name] = hit
            if ctx.is_main:
                log(f"{name}: stored result reused ({result_path(out_dir, name)}); rerun=True measures again")
            continue
        if GRID[name].distributed and ctx.world_size < 2:
            raise ValueError(f"{name} needs several ranks: launch with torchrun --nproc-per-node=N")
        result = measure_one(sft, name, argv, lora_r, out_dir)
        result["signature"] = sig
        results[name] = result
        if ctx.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            tmp = result_path(out_dir, name).with_suffix(".tmp")
            tmp.write_text(json.dumps(result, indent=1, default=float))
            tmp.replace(result_path(out_dir, name))
            log(f"{name}: {result['error'] or 'ran'}, {result.get('tokens_per_s', float('nan')):,.0f} tokens/s, "
                f"{result['wall_seconds']:.1f} s")
    return results


# --- reading the results (chapter 11's table, scatter plot and ranking) ----------------------------
def per_rank(result: dict) -> dict:
    """The figures of the rank that holds the most (sharded ranks differ by a straddling parameter at
    most): model-state bytes by kind, host-tier bytes, the largest micro-batch's saved activations and
    autocast weight copies, and `device` = what stays on the accelerator = model states - host tier +
    saved activations + weight copies."""
    rows = []
    for r in result["ranks"]:
        s = r["states"] or {"params": 0, "grads": 0, "optimizer": 0, "host": 0, "total": 0}
        saved = max(r["saved_per_micro"] or [0])
        copies = max(r.get("weight_copies_per_micro") or [0])
        rows.append({**{k: s[k] for k in ("params", "grads", "optimizer", "host")}, "states": s["total"],
                     "saved": saved, "copies": copies, "device": s["total"] - s["host"] + saved + copies,
                     "cuda_peak": r.get("cuda_peak", 0)})
    return max(rows, key=lambda row: row["device"])


def ranking(rows: dict, tolerance: float) -> list[dict]:
    """"What to turn on first", from measurements only. `rows`: {name: {"ref", "device", "tokens_per_s"}}.

    Each configuration is compared with its reference (the row it changes one thing of): memory =
    device bytes per rank / the reference's, speed = tokens/s / the reference's. Then, in this order:
    1. "free": less memory and not slower (speed >= 1 - tolerance: timing noise), most memory saved first;
    2. "trade": less memory for some speed, most memory saved per unit of speed lost first;
    3. "speed only": no less memory per rank, but faster (DDP: more ranks, the same bytes each);
    4. "neither": what this machine measured as no help.
    """
    out = []
    for name, row in rows.items():
        ref = rows.get(row.get("ref"))
        if ref is None or not row.get("tokens_per_s") or not ref.get("tokens_per_s"):
            continue
        memory, speed = row["device"] / ref["device"], row["tokens_per_s"] / ref["tokens_per_s"]
        if memory < 1 and speed >= 1 - tolerance:
            kind, score = "free", 1 - memory
        elif memory < 1:
            kind, score = "trade", (1 - memory) / (1 - speed)
        elif speed > 1 + tolerance:
            kind, score = "speed only", speed
        else:
            kind, score = "neither", -memory
        out.append({"config": name, "ref": row["ref"], "memory": memory, "speed": speed, "kind": kind, "score": score})
    order = {"free": 0, "trade": 1, "speed only": 2, "neither": 3}
    return sorted(out, key=lambda r: (order[r["kind"]], -r["score"]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)  # sft's --accum != --accum-k
    p.add_argument("--configs", required=True, help=f"comma-separated, from: {', '.join(GRID)}")
    p.add_argument("--out-dir", required=True, help="one <config>.json per configuration")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank of the lora configuration")
    p.add_argument("--accum-k", type=int, default=4, help="micro-batches the accumulation rows split a batch into")
    p.add_argument("--rerun", action="store_true", help="measure again even where a stored result matches")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p.parse_known_args(argv)  # the rest goes to sft.py


def main(argv=None) -> dict:
    args, common = parse_args(argv)
    results = run([n.strip() for n in args.configs.split(",") if n.strip()], common, args.out_dir,
                  lora_r=args.lora_r, accum_k=args.accum_k, rerun=args.rerun)
    if int(os.environ.get("RANK", "0")) == 0:
        cl.dist.report(results)
    cl.dist.close()
    return results


if __name__ == "__main__":
    main()
