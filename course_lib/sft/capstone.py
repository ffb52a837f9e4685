"""The capstone's grid (chapter 11), as a library: configurations, what a rank holds, the ranking, the summary.

Each configuration is a variant of the SFT recipe's config (`dataclasses.replace`: `variant_config`).
`measured(Backend)` is a backend subclass (course_lib/sft/backends.py) that, during the first optimizer step
(which the recipe leaves out of tokens/s), records per rank:

- model states: the parameter, gradient and optimizer-state bytes this rank holds (FSDP2: local shards;
  DeepSpeed: `cl.zero.held_bytes` and `GradPeak`), and which of them DeepSpeed put on the host tier;
- saved activations per micro-batch (`SavedActivations`: parameters left out wherever FSDP2 or ZeRO-3
  gathered them; autocast's 16-bit weight copies counted apart).

Results are stored one file per configuration with a `signature` of everything that shaped them, so a
grid resumes where it stopped (`cached`). `per_rank`, `ranking` and the summary (`write_summary` /
`read_summary`, read by the report's front page) turn them into chapter 11's table and verdict.
The recipe course_lib/recipes/capstone.py runs the grid; chapter 11 explains and plots it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import platform
import re
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..env import hardware_report
from ..memory.measure import SavedTensors, local, model_state_bytes, tensor_bytes
from ..timing import Spread, compare, spread, verdict

class _LinesOnce:
    """A text stream that passes each distinct line on once (a launch's "[rank N] " prefix ignored)."""

    def __init__(self, out, seen: set):
        self.out, self.seen, self.partial = out, seen, ""

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            key = re.sub(r"^\[rank \d+\] ", "", line).strip()
            if not key or key not in self.seen:
                self.seen.add(key)
                self.out.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def lines_once(seen: set):
    """Print what runs inside with each distinct line once across every block given the same `seen` set: the grid
    calls sft.train() once per configuration, and every call describes the same data in the same words."""
    stream = _LinesOnce(sys.stdout, seen)
    with contextlib.redirect_stdout(stream):
        try:
            yield
        finally:
            if stream.partial:
                stream.write("\n")


SCHEMA = 6  # what a stored result contains; raise it when the measuring changes, and stored results are redone
SUMMARY_SCHEMA = 2  # 2: compare rows name their "source" article


@dataclass(frozen=True)
class Variant:
    label: str                  # how the table names it
    changes: tuple = ()         # (config field, value) pairs it sets on the SFT config
    distributed: bool = False   # needs several ranks (one launch for all of them)
    ref: str | None = None      # the configuration it changes one thing of (for the ranking); "base": the precision row
    accum: bool = False         # split the micro-batch into `accum_split` micro-batches (same tokens per step)
    combination: bool = False   # adds a factor on top of another technique (ranked after the single factors)


# The grid: baseline, one factor at a time, then the distributed ones against DDP (the tuning method of a source
# article on fine-tuning optimizations: its section on choosing the best combination).
GRID = {
    "fp32": Variant("fp32 baseline", (("precision", "fp32"),)),
    "bf16": Variant("+ bf16 autocast", (("precision", "bf16"),), ref="fp32"),
    "ckpt": Variant("+ activation checkpointing", (("act_ckpt", True),), ref="base"),
    "accum": Variant("+ gradient accumulation", (), ref="base", accum=True),
    "ckpt_accum": Variant("+ checkpointing + accumulation", (("act_ckpt", True),), ref="ckpt", accum=True,
                          combination=True),
    "lora": Variant("LoRA adapters, fp32 base", (("lora", True),), ref="base"),
    "ddp": Variant("DDP", (), distributed=True, ref="base"),
    "zero1": Variant("ZeRO-1", (("deepspeed", "zero1"),), distributed=True, ref="ddp"),
    "zero2": Variant("ZeRO-2", (("deepspeed", "zero2"),), distributed=True, ref="ddp"),
    "zero2_ckpt": Variant("ZeRO-2 + checkpointing", (("deepspeed", "zero2"), ("act_ckpt", True)), distributed=True,
                          ref="zero2", combination=True),
    "zero3": Variant("ZeRO-3", (("deepspeed", "zero3"),), distributed=True, ref="ddp"),
    "zero3_offload": Variant("ZeRO-3 + offload", (("deepspeed", "zero3_offload"),), distributed=True, ref="zero3",
                             combination=True),
    "fsdp2": Variant("FSDP2", (("fsdp", True),), distributed=True, ref="ddp"),
}
SINGLE = [n for n, v in GRID.items() if not v.distributed]
# The precision of every multi-rank row, whatever the one-process rows use: in bf16 DeepSpeed computes on 16-bit
# weights (an fp32 master beside them) while DDP and FSDP2 keep fp32 weights under autocast, so a ZeRO row against
# DDP would change the precision as well as the sharding. In fp32 only the sharding changes; their reference is
# the one-process fp32 row.
RANK_PRECISION = "fp32"
DISTRIBUTED = [n for n, v in GRID.items() if v.distributed]
# On one GPU the distributed rows run as CPU ranks at the cpu profile's sizes (`cl.presets.ranks_plan`): their
# reference is then measured again at those sizes, in one process on the CPU, and named this (not a grid row).
RANK_BASE = "rank_base"


def variant(name: str) -> Variant:
    """The grid's `Variant` of `name`; RANK_BASE: the base precision at the ranks' sizes (one GPU, chapter 11)."""
    return Variant("one process, the ranks' sizes") if name == RANK_BASE else GRID[name]


def faster_precision(results: dict, precision: str | None = None) -> str:
    """Chapter 11's base precision: `precision` if given, else the faster of the "fp32" and "bf16" rows of `results`
    ({name: result}; "fp32" if neither ran)."""
    speed = {k: results[k].get("tokens_per_s") or 0.0 for k in ("fp32", "bf16") if k in results}
    return precision or (max(speed, key=speed.get) if speed else "fp32")


def check_names(names) -> None:
    unknown = [n for n in names if n not in GRID]
    if unknown:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown)}: choose from {', '.join(GRID)}")


def variant_config(name: str, cfg, accum_split: int):
    """The SFT config of configuration `name`: `cfg` with the variant's changes, measuring-only settings
    (no evaluation, export or progress bar) and its own run directory under `cfg.out_dir`."""
    v = GRID[name]
    out = replace(cfg, **dict(v.changes))
    if v.accum:
        if cfg.micro_batch % accum_split:
            raise ValueError(f"--micro-batch {cfg.micro_batch} must be a multiple of --accum-split {accum_split}")
        out = replace(out, micro_batch=cfg.micro_batch // accum_split, accum=accum_split)
    if out.lora:  # the grid's LoRA: alpha = 2r, no dropout (chapter 09); one factor at a time: which weights train,
        # the base held as the row it is measured against holds it (fp32 master weights), not also in bf16
        out = replace(out, lora_alpha=2.0 * cfg.lora_r, lora_dropout=0.0, lora_base_dtype="fp32")
    return replace(out, eval_n=0, eval_before=False, export=False, progress=False, save_every=0, resume=None,
                   out_dir=str(Path(cfg.out_dir) / "runs" / name))


# --- what a rank holds, measured during the first optimizer step ---------------------------------
class SavedActivations(SavedTensors):
    """`SavedTensors` that looks the parameters up when a tensor is saved, not once at the start: FSDP2 and
    ZeRO-3 swap full weights in and out during the forward, at addresses the parameters did not have before.
    Autocast's 16-bit copies of trainable weights (a cast whose input is a parameter) are counted apart, in
    `copies`: saved for backward, but their size follows the model, not the batch."""

    VIEWS = ("TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
             "ExpandBackward0")

    def __init__(self, module: torch.nn.Module):
        super().__init__(model=None)
        self.module = module
        self.copies, self._copy_ptrs = 0, set()

    def skip(self, t) -> bool:
        if self._is_parameter(t):
            return True
        if self._is_weight_copy(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._copy_ptrs:
                self._copy_ptrs.add(ptr)
                self.copies += t.untyped_storage().nbytes()
            return True
        return False

    def _is_parameter(self, t) -> bool:
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            return True
        ptr = t.untyped_storage().data_ptr()
        return any(local(p).untyped_storage().data_ptr() == ptr for p in self.module.parameters())

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


class Measuring:
    """A mixin for a backend: saved activations of every micro-batch's forward, model states after the first
    optimizer step, no checkpoints. Use `measured(backend_class)`."""

    def setup(self, model) -> None:
        super().setup(model)
        self.saved, self.copies, self.states, self._open = [], [], None, None
        self.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self._hooks = [self.model.register_forward_pre_hook(self._enter), self.model.register_forward_hook(self._exit)]
        if self.name == "deepspeed":
            from ..parallel.zero import GradPeak

            self._grad_peak = GradPeak(self.engine)

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
        ds = self.name == "deepspeed"
        grads = self._grad_peak.bytes.get("backward", 0) if ds else tensor_bytes(p.grad for p in self.module.parameters())
        norm = super().step()
        if ds:  # after the step: the optimizer state exists
            from ..parallel.zero import held_bytes

            held = held_bytes(self.engine)
            states = {"params": held["params"], "grads": grads, "optimizer": held["optimizer"], "host": held["host"]}
            self._grad_peak.remove()
        else:
            held = model_state_bytes(self.module, self.optimizer)
            states = {"params": held["params"], "grads": grads, "optimizer": held["optimizer"], "host": 0}
        states["total"] = states["params"] + states["grads"] + states["optimizer"]
        self.states = states
        self.adamw_kernel = adamw_kernel(getattr(self.engine, "basic_optimizer", None) if ds else self.optimizer)
        for h in self._hooks:  # measured once: the later, timed steps run without hooks
            h.remove()
        return norm

    def save(self, path, meta) -> None:  # the grid measures; it keeps no checkpoints
        pass


def adamw_kernel(optimizer) -> str | None:
    """Which kernel a torch Adam/AdamW steps with ("fused", "foreach", "for-loop"), or another optimizer's class name
    (DeepSpeed's CPU Adam under offload); None when there is none to read."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return type(optimizer).__name__
    d = optimizer.defaults
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop"


def measured(backend_class: type) -> type:
    """`backend_class` (course_lib.sft.backends) with the `Measuring` mixin in front."""
    return type(f"Measured{backend_class.__name__}", (Measuring, backend_class), {})


# --- stored results --------------------------------------------------------------------------------
# settings of the grid's config that do not change a configuration's numbers (its variant config carries the rest)
NOT_SHAPING = ("out_dir", "configs", "rerun", "accum_split")


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else None


def signature(name: str, cfg, ranks: int) -> dict:
    """Everything that shapes a configuration's numbers; a stored result is reused only if it matches: its
    SFT config (the run directory aside), ranks, hardware, and the contents of the model's config.json and
    of the training data (a directory rewritten with another model shape or task keeps its path)."""
    info = hardware_report(show=False)
    settings = {k: v for k, v in asdict(cfg).items() if k not in NOT_SHAPING}
    files = {"config.json": _digest(Path(cfg.model_path) / "config.json"),
             "train.jsonl": _digest(Path(cfg.data_dir) / "train.jsonl")}
    return {"schema": SCHEMA, "config": name, "settings": settings, "files": files, "ranks": ranks,
            "hardware": {k: info.get(k) for k in ("cpu", "cpu_cores", "gpu", "torch", "deepspeed")},
            "host": platform.node()}


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


def store(out_dir, name: str, result: dict) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = result_path(out_dir, name).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=float))
    tmp.replace(result_path(out_dir, name))


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


NO_SLOWDOWN = "no slowdown measured"


def time_per_token(result: dict) -> Spread | None:
    """Seconds per token (all ranks' tokens) of each optimizer step after the first (warm-up), as a `Spread`: the
    row's own repeats, what the ranking's verdicts rest on. None for a row that did not run."""
    seconds, tokens = result.get("seconds") or [], result.get("tokens") or []
    samples = [s / t for s, t in zip(seconds, tokens) if t]
    samples = samples[1:] or samples
    return Spread(samples) if samples else None


def ranking(rows: dict) -> list[dict]:
    """"What to turn on first", from measurements only. `rows`: {name: {"ref", "device", "time"}}, "time" the row's
    seconds per token over its steps (a `cl.timing.Spread`, or the samples).

    Each configuration is compared with its reference (the row it changes one thing of): memory = device bytes per
    rank / the reference's (exact: bytes counted); time = `cl.timing.verdict` of the two spreads, which calls a row
    faster or slower only if their ranges do not overlap, else "indistinguishable". Then, in this order:
    1. "no slowdown measured", if it needs less memory and its time is indistinguishable or faster. Not "free": a
       cost inside the spread is still a cost, a CPU hides costs a GPU shows (recomputation: about a third more
       FLOPs), and LoRA changes what is learned;
    2. "trade", if it needs less memory and its time is slower;
    3. "speed only", if it needs no less memory per rank and its time is faster (DDP: more ranks, the same bytes each);
    4. "neither", if this machine measured it as no help.
    Within each, the row that needs the least memory against its reference comes first: the order never rests on a
    difference of time that the spreads did not separate.
    """
    out = []
    for name, row in rows.items():
        ref = rows.get(row.get("ref"))
        if ref is None or row.get("time") is None or ref.get("time") is None:
            continue
        mine, theirs = spread(row["time"]), spread(ref["time"])
        memory, word = row["device"] / ref["device"], verdict(mine, theirs)
        if memory < 1:
            kind = "trade" if word == "slower" else NO_SLOWDOWN
        else:
            kind = "speed only" if word == "faster" else "neither"
        out.append({"config": name, "ref": row["ref"], "memory": memory, "speed": theirs.median / mine.median,
                    "verdict": word, "kind": kind,
                    "comparison": compare(mine, theirs, name, row["ref"], unit="µs")})
    order = {NO_SLOWDOWN: 0, "trade": 1, "speed only": 2, "neither": 3}
    return sorted(out, key=lambda r: (order[r["kind"]], r["memory"]))


# --- the summary the report's front page reads ---------------------------------------------------
ROW_FIELDS = ("label", "precision", "ranks", "states", "host", "saved", "copies", "device", "tokens_per_s", "fit")


def write_summary(path, *, profile: str, hardware: dict, base: str, ranks: int, params: int, unit: str, budget,
                  budget_note: str, rows: dict, ranked: list, fastest_that_fits, compare: list) -> Path:
    """Chapter 11's summary (build/capstone/summary.json): the one definition of its layout."""
    summary = {
        "schema": SUMMARY_SCHEMA, "profile": profile, "device": hardware["device"], "cpu": hardware["cpu"],
        "bf16_native": hardware["bf16_native"], "base": base, "ranks": ranks, "params": params, "unit": unit,
        "budget": budget, "budget_note": budget_note,
        "rows": [{"config": n, **{k: row[k] for k in ROW_FIELDS}, **({"unit": row["unit"]} if "unit" in row else {})}
                 for n, row in rows.items()],  # "unit": a row of other sizes (one GPU's CPU ranks: MiB)
        "ranking": [{**r, "combination": variant(r["config"]).combination} for r in ranked],
        "fastest_that_fits": fastest_that_fits,
        "compare": [{"what": w, "source": s, "theirs": t, "ours": o} for w, s, t, o in compare],
    }
    path = Path(path)
    path.write_text(json.dumps(summary, indent=1, default=float))
    return path


def read_summary(path) -> dict | None:
    """The summary `write_summary` wrote, or None when there is none (or one of an older layout)."""
    path = Path(path)
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    return summary if summary.get("schema") == SUMMARY_SCHEMA else None
