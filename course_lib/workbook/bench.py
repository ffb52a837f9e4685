"""The benchmark of chapter 10 section 6: the SFT recipe against Hugging Face Trainer, side by side.

    make bench                                                        # Qwen2.5-0.5B's shape, one process
    python -m course_lib.workbook.bench --shape tiny|0.5b --steps 10 --backend single|ddp|fsdp [--ablate]
    python -m course_lib.workbook.bench --masking                     # the loss mask's cost against a plain render

One command runs both, one after the other, each in a process of its own (so its peak memory is its own): the
recipe (course_lib/recipes/sft.py with the speed paths that paid here, `FAST`) and `Trainer`
(course_lib/recipes/sft_trainer.py: its defaults, length-grouped sampling, bf16 where the hardware has it natively,
its padding-free collator). Both get the same checkpoint directory (0.5b: a random-init model of Qwen2.5-0.5B's shape
with Qwen's own tokenizer, the one tests/test_real_shape.py builds, cached in build/cache), the same synthetic chats
(token lengths log-normal, median ~150, 95th percentile ~600, capped at --seq-len), the same AdamW, learning rate,
schedule and examples per optimizer step. Per side: target (trained) and processed tokens per second over the steps
after warm-up, the median seconds per step, peak memory, the loss; then the ratio. `--ablate` adds the recipe without
any speed path and with each one alone: which gain comes from which change. Output: a table, one JSON line, and a
ledger in build/results/bench_<shape>_<backend>.json (build/report.html shows it). Notebook-side: it launches.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

import course_lib as cl
from course_lib.sft import data as D
from course_lib.recipes import sft, sft_trainer

# Defaults per shape, sized so the whole command stays under 10 minutes on a 2-core CPU at the 0.5b shape.
SHAPES = {"tiny": dict(seq_len=512, micro_batch=8, steps=40, skip=5, lr=1e-3, eval_n=16),
          "0.5b": dict(seq_len=1024, micro_batch=4, steps=10, skip=2, lr=1e-4, eval_n=8)}
# Each speed path of the recipe alone (--ablate): padding-free rows against the plain recipe, then every other one
# against padding-free rows (the first thing anyone turns on: Trainer has them too). FAST: the ones that paid here.
BASE = dict(padding_free=True)
CHANGES = {"loss_chunk": dict(loss_chunk=1024), "compile": dict(compile=True), "prefetch": dict(prefetch=True),
           "optim": None}  # optim: the AdamW kernel the backend does not use by default (`variants`)
# The chunked loss is not among them: it recomputes the head's logits in backward, time for memory (it stays a flag,
# for vocabularies and sequences whose logits do not fit); `--ablate` measures each on the machine at hand.
FAST = dict(padding_free=True, compile=True)
GPU = {"tiny": dict(micro_batch=32), "0.5b": dict(seq_len=2048, micro_batch=16, steps=30, skip=5)}  # on a GPU
TARGET = {"tiny": 1.0, "0.5b": 1.2}  # the bar for recipe / Trainer target tokens per second: 1.2x at the real shape
SYSTEM = "You are a helpful assistant."
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


# --- the data: chats whose token lengths are spread like real ones --------------------------------------------------
def _words(rng: random.Random, k: int) -> str:
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(max(1, k)))


def tokens_per_word(tokenizer, seed: int = 0) -> float:
    text = _words(random.Random(seed), 500)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) / 500


def synthetic_chats(n: int, tokenizer, seq_len: int, median: float = 150, p95: float = 600, seed: int = 0) -> list[dict]:
    """`n` conversations (a system prompt, 1-3 user/assistant turns) whose rendered token counts follow a log-normal
    with this median and 95th percentile, capped at `seq_len`. The assistant says 25-85% of each chat's words
    (uniform), so about half the tokens are trained, as in instruction data."""
    rng, per_word = random.Random(seed), tokens_per_word(tokenizer, seed)
    sigma = math.log(p95 / median) / 1.6449  # the 95th percentile of N(0, 1)
    frame = {t: len(D.assistant_mask(tokenizer, _chat([""] * 2 * t)["messages"])[0]) for t in (1, 2, 3)}  # template
    chats = []
    for _ in range(n):
        turns = rng.choices((1, 2, 3), weights=(6, 3, 1))[0]
        total = min(seq_len, max(32, round(rng.lognormvariate(math.log(median), sigma))))
        content, share = max(2 * turns, total - frame[turns]), rng.uniform(0.25, 0.85)
        texts = [_words(rng, round(content * part / turns / per_word)) for _ in range(turns) for part in (1 - share, share)]
        chats.append(_chat(texts))
    return chats


def _chat(texts: list[str]) -> dict:
    """A system prompt, then user and assistant turns alternating with these texts."""
    return {"messages": [{"role": "system", "content": SYSTEM}] + [{"role": ("user", "assistant")[i % 2], "content": t}
                                                                    for i, t in enumerate(texts)]}


def train_chats(timed_steps: int, global_batch: int) -> int:
    """4 x global batch x timed steps. Trainer's length grouping (transformers' `get_length_grouped_indices`) sorts
    mega-batches of min(n / (4 x batch), 50) batches, longest first: timed steps that make whole mega-batches hold the
    recipe's shuffled mix of lengths on average (fewer, after warm-up, would time a mega-batch's short end)."""
    return 4 * global_batch * max(1, timed_steps)


def prepare(shape: str, work: Path, n_train: int, seq_len: int, eval_n: int, seed: int = 0) -> dict:
    """The model directory and the data directory (train.jsonl, eval.jsonl) both sides read, and the data's shape."""
    cache = cl.results.REPO_ROOT / "build" / "cache"
    if shape == "0.5b":
        tokenizer_dir = cl.tokenizer.fetch_qwen_tokenizer(cache / "tokenizer-qwen3")
        model_path = cl.model_dir.make_checkpoint(cache / "qwen2.5-0.5b-shape", tokenizer_dir, cl.models.QWEN25["Qwen2.5-0.5B"])
    else:
        texts = [f"system\n{SYSTEM}\nuser\n{_words(random.Random(seed + i), 200)}\nassistant\n" for i in range(200)]
        size = {k: v for k, v in cl.models.TINY.items() if k != "vocab_size"}
        model_path = cl.model_dir.make_tiny_checkpoint(work / "tiny-model", texts, size, vocab_size=1024, seed=seed)
    tokenizer = cl.model_dir.load_tokenizer(model_path)
    data_dir = work / "data"
    train = synthetic_chats(n_train, tokenizer, seq_len, seed=seed)
    D.write_jsonl(train, data_dir / "train.jsonl")
    D.write_jsonl(synthetic_chats(eval_n, tokenizer, seq_len, seed=seed + 1), data_dir / "eval.jsonl")
    rows, _ = D.tokenize_chats(train, tokenizer, seq_len)
    lengths = sorted(len(r["input_ids"]) for r in rows)
    trained = sum(sum(t != D.IGNORE for t in r["labels"][1:]) for r in rows)
    return {"model_path": str(model_path), "data_dir": str(data_dir), "examples": len(rows),
            "median_tokens": statistics.median(lengths), "p95_tokens": lengths[int(0.95 * (len(lengths) - 1))],
            "trained_share": trained / sum(lengths), "mean_tokens": sum(lengths) / len(lengths)}


# --- the runs ---------------------------------------------------------------------------------------------------------
def variants(backend: str, ablate: bool, fast: dict = FAST) -> dict:
    """{name: (recipe flags, the variant it is compared with)}: `fast` (FAST); with --ablate also `plain` (no speed
    path), `padding_free` (BASE) and each change of CHANGES alone on top of BASE."""
    if not ablate:
        return {"fast": (fast, None)}
    other_kernel = "fused" if backend == "fsdp" else "foreach"  # the kernel the backend does not use by default
    out = {"plain": ({}, None), "padding_free": (BASE, "plain")}
    for name, flags in CHANGES.items():
        out[name] = ({**BASE, **(flags if flags is not None else {"optim_impl": other_kernel})}, "padding_free")
    return {**out, "fast": (fast, "padding_free")}


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine spent busy, CPU seconds of this process and its finished children); Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    ours = sum(getattr(resource.getrusage(who), k) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for k in ("ru_utime", "ru_stime"))
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), ours


def run_side(cfg, nproc: int, in_process: bool, label: str) -> dict:
    """One side's results: launched (torchrun, a process of its own) or, with `in_process`, in this process. Also
    `other_load`: the share of the machine's cores that other programs kept busy meanwhile (their work slows a
    timing down: above ~0.1 the figures are noisy)."""
    t0, c0 = time.perf_counter(), _cpu_seconds()
    if in_process:  # what a side prints (Trainer's log lines, samples) stays out of the notebook unless it fails
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                res = (sft if isinstance(cfg, sft.Config) else sft_trainer).train(cfg)
        except BaseException:
            print(printed.getvalue()[-4000:], flush=True)
            raise
    else:  # a launch takes minutes: say what runs
        print(f"[bench] {label}: {nproc} process(es) ...", flush=True)
        res = cl.launch(cfg, nproc=nproc, timeout=1800, quiet=True).result
    wall, c1 = time.perf_counter() - t0, _cpu_seconds()
    if c0 and c1:
        res["other_load"] = max(0.0, (c1[0] - c0[0]) - (c1[1] - c0[1])) / (wall * cl.env.cpu_cores())
    load = f", other programs' load {res['other_load']:.0%}" if "other_load" in res else ""
    print(f"[bench] {label}: done in {wall:.0f} s{' in this process' if in_process else ''}{load}", flush=True)
    return res


def side_summary(res: dict, skip: int, in_process: bool) -> dict:
    """Throughput over the steps after the first `skip` (warm-up: allocators, compilation), the loss, memory."""
    n = len(res["seconds"])
    skip = min(skip, n - 1)
    timed = slice(skip, None)
    seconds = sum(res["seconds"][timed])
    half = res["loss"][n // 2:]
    cuda = max(res.get("cuda_peak_per_rank") or [0])
    rss = max(p.get("trained", 0) for p in res["rss_phases_per_rank"])
    return {"backend": res["backend"], "precision": res["precision"], "steps": n, "warmup_steps": skip,
            "target_tokens_per_s": sum(res["targets"][timed]) / seconds,
            "processed_tokens_per_s": sum(res["batch_tokens"][timed]) / seconds,
            "real_tokens_per_s": sum(res["tokens"][timed]) / seconds,
            "median_step_s": statistics.median(res["seconds"][timed]), "warmup_s": sum(res["seconds"][:skip]),
            # each timed step's seconds per target token: the spread a comparison of two sides rests on (the sides
            # draw their batches in different orders, so steps are compared per target token)
            "s_per_target": [t / max(k, 1) for t, k in zip(res["seconds"][timed], res["targets"][timed])],
            # end to end: every step's target tokens over every step's seconds, the warm-up (compilation) included
            "end_to_end_target_tokens_per_s": sum(res["targets"]) / sum(res["seconds"]),
            # over the timed steps, as the tokens/s are: their ratio is what the same-speed prediction divides
            "targets_per_step": sum(res["targets"][timed]) / (n - skip),
            "processed_per_step": sum(res["batch_tokens"][timed]) / (n - skip),
            "peak_memory_gb": None if in_process else (cuda or rss) / 1e9, "memory_kind": "CUDA" if cuda else "RSS",
            "loss_last_half": statistics.mean(half), "loss_se": statistics.stdev(half) / math.sqrt(len(half)) if len(half) > 1 else 0.0,
            "held_out_loss": res["eval"][-1]["loss"] if res.get("eval") else None, "other_load": res.get("other_load")}


def mfu(side: dict, data: dict, model_path: str, peak: float) -> float:
    """Model-FLOPs utilization: 6N + 12·L·h·s per processed token (s: the mean example) times tokens/s, over `peak`."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    n = cl.memory.count_params(config)
    fpt = cl.flops_per_token(n, config["num_hidden_layers"], config["hidden_size"], round(data["mean_tokens"]))
    return side["processed_tokens_per_s"] * fpt / peak


def run(shape: str = "0.5b", steps: int | None = None, backend: str = "single", nproc: int = 2, ablate: bool = False,
        in_process: bool = False, work=None, compile: bool = True, **overrides) -> dict:
    """The benchmark; returns the summary (what the JSON line holds). `overrides`: seq_len, micro_batch, accum, lr,
    skip, eval_n. `in_process` (one process only) runs both sides in this process: no launches, no peak memory.
    `compile=False`: neither side compiles (FAST without its compiled layers, Trainer without torch_compile)."""
    t0 = time.perf_counter()
    if shape not in SHAPES or backend not in ("single", "ddp", "fsdp"):
        raise ValueError(f"--shape is tiny or 0.5b and --backend single, ddp or fsdp; got {shape!r}, {backend!r}")
    device = cl.pick_device()
    opts = {**SHAPES[shape], **(GPU[shape] if device.type == "cuda" else {})}
    opts.update({k: v for k, v in overrides.items() if v is not None}, steps=steps or opts["steps"])
    world = 1 if backend == "single" else nproc
    if in_process and world > 1:
        raise ValueError("in_process runs one process: use --backend single")
    work = Path(work or cl.results.build_dir() / "bench" / f"{shape}_{backend}")
    accum = opts.get("accum", 1)
    data = prepare(shape, work, train_chats(opts["steps"] - opts["skip"], opts["micro_batch"] * accum * world),
                   opts["seq_len"], opts["eval_n"])
    base = sft.Config(model_path=data["model_path"], data_dir=data["data_dir"], out_dir=str(work / "recipe"),
                      steps=opts["steps"], micro_batch=opts["micro_batch"], accum=accum, lr=opts["lr"],
                      seq_len=opts["seq_len"], eval_n=opts["eval_n"], fsdp=backend == "fsdp", progress=False,
                      export=False, save=False, log_every=10**6)
    # Trainer compiles its model (its own torch_compile) where the recipe's kept changes compile: the same tool on
    # both sides
    fast_flags = {k: v for k, v in FAST.items() if compile or k != "compile"}
    trainer_cfg = sft_trainer.from_sft(base, out_dir=str(work / "trainer"), torch_compile=fast_flags.get("compile", False))
    results = {"trainer": run_side(trainer_cfg, world, in_process, "trainer")}
    if ablate:  # Trainer without length grouping: what grouping costs or gains with padding-free batches
        results["trainer_random"] = run_side(replace(trainer_cfg, out_dir=str(work / "trainer_random"),
                                                     group_by_length=False), world, in_process, "trainer random")
    plan = variants(backend, ablate, fast_flags)
    for name, (flags, _) in plan.items():
        results[name] = run_side(replace(base, out_dir=str(work / name), **flags), world, in_process, f"recipe {name}")
    sides = {k: side_summary(v, opts["skip"], in_process) for k, v in results.items()}
    precision = sides["trainer"]["precision"]
    peak = cl.timing.matmul_flops(8192 if device.type == "cuda" else 2048, torch.bfloat16 if precision == "bf16"
                                  else torch.float32, device)
    for name, side in sides.items():
        side["mfu"] = mfu(side, data, data["model_path"], peak)
        side["vs_trainer"] = side["target_tokens_per_s"] / sides["trainer"]["target_tokens_per_s"]
        side["flags"], ref = plan.get(name, ({}, None))
        if ref:
            side["vs"], side["gain"] = ref, side["target_tokens_per_s"] / sides[ref]["target_tokens_per_s"]
    fast, trainer = sides["fast"], sides["trainer"]
    noise = 2 * math.hypot(fast["loss_se"], trainer["loss_se"])
    summary = {"shape": shape, "backend": backend, "world_size": world, "device": str(device),
               "cpu_cores": cl.env.cpu_cores(), "bf16_native": cl.native_bf16(), "opts": opts, "data": data,
               "fast": fast_flags, "peak_flops": peak, "sides": sides,
               "ratio": fast["target_tokens_per_s"] / trainer["target_tokens_per_s"], "target": TARGET[shape],
               "ratio_end_to_end": fast["end_to_end_target_tokens_per_s"] / trainer["end_to_end_target_tokens_per_s"],
               "trainer_compiled": trainer_cfg.torch_compile,
               "loss_diff": fast["loss_last_half"] - trainer["loss_last_half"], "loss_noise": noise}
    summary["loss_within_noise"] = abs(summary["loss_diff"]) <= noise
    summary["bench_seconds"] = time.perf_counter() - t0
    record(summary, device)
    return summary


# --- the report -------------------------------------------------------------------------------------------------------
LABELS = {"warmup_steps": "warm-up steps (untimed)", "targets_per_step": "target tokens/step",
          "processed_per_step": "processed tokens/step",
          "end_to_end_target_tokens_per_s": "end-to-end target tok/s"}


def table(summary: dict) -> str:
    sides, rows = summary["sides"], []
    names = [k for k in sides if not k.startswith("trainer")] + [k for k in sides if k.startswith("trainer")]
    fmt = {"warmup_steps": "{:d}", "target_tokens_per_s": "{:,.1f}", "processed_tokens_per_s": "{:,.1f}",
           "targets_per_step": "{:,.0f}", "processed_per_step": "{:,.0f}", "median_step_s": "{:.2f}", "warmup_s": "{:.1f}",
           "end_to_end_target_tokens_per_s": "{:,.1f}", "peak_memory_gb": "{:.2f}", "loss_last_half": "{:.4f}",
           "held_out_loss": "{:.4f}", "mfu": "{:.1%}", "other_load": "{:.0%}"}
    rows.append(f"{'':24s}" + "".join(f"{n:>15s}" for n in names))
    for key, f in fmt.items():
        cells = [f.format(sides[n][key]) if sides[n].get(key) is not None else "-" for n in names]
        rows.append(f"{LABELS.get(key, key):24s}" + "".join(f"{c:>15s}" for c in cells))
    rows.append(f"{'x Trainer':24s}" + "".join(f"{sides[n]['vs_trainer']:>14.2f}x" for n in names))
    if all("end_to_end_target_tokens_per_s" in sides[n] for n in names):  # (a ledger written before it had none)
        rows.append(f"{'x Trainer, end to end':24s}" + "".join(
            f"{sides[n]['end_to_end_target_tokens_per_s'] / sides['trainer']['end_to_end_target_tokens_per_s']:>14.2f}x"
            for n in names))
    if len(sides) > 2:  # --ablate: each change against the variant it adds to
        rows.append(f"{'x the variant before':24s}" + "".join(f"{sides[n]['gain']:>14.2f}x" if "gain" in sides[n]
                                                                else f"{'-':>15s}" for n in names))
        rows.append(f"{'  (which)':24s}" + "".join(f"{sides[n].get('vs', '-'):>15s}" for n in names))
    d = summary["data"]
    rows.append(f"recipe (fast: {', '.join(f'{k}={v}' for k, v in summary['fast'].items())}) / Trainer "
                f"({'compiled' if summary.get('trainer_compiled') else 'not compiled'}), target tokens/s after the warm-up: "
                f"{summary['ratio']:.2f}x (bar: {summary['target']}x)"
                + (f", end to end {summary['ratio_end_to_end']:.2f}x" if "ratio_end_to_end" in summary else "")
                + f"; loss diff {summary['loss_diff']:+.4f} "
                f"(noise {summary['loss_noise']:.4f}: {'within' if summary['loss_within_noise'] else 'OUTSIDE'})")
    if max(sides[n].get("other_load") or 0 for n in names) > 0.1:
        rows.append("warning: other programs kept > 10% of the cores busy during some runs: those figures are noisy")
    rows.append(f"data: {d['examples']} chats, tokens median {d['median_tokens']:.0f}, p95 {d['p95_tokens']}, "
                f"trained share {d['trained_share']:.0%}; {summary['device']}, {summary['world_size']} process(es), "
                f"{sides['trainer']['precision']}")
    return "\n".join(rows)


def explain(summary: dict) -> str:
    """Which gain comes from which change, in sentences, from the measured figures."""
    sides, out = summary["sides"], []
    x = lambda name: sides[name]["target_tokens_per_s"] / sides["trainer"]["target_tokens_per_s"]  # noqa: E731
    if "plain" in sides:
        plain, free = sides["plain"], sides["padding_free"]
        out.append(f"- padding-free rows: x{free['gain']:.2f} over the padded recipe, which computed "
                   f"{plain['processed_per_step'] / free['processed_per_step']:.2f}x the tokens per step (padding).")
        out.append(f"- with padding-free rows on both sides the recipe runs x{x('padding_free'):.2f} Trainer: what still "
                   f"differs is its LM head and loss at the trained positions only ({summary['data']['trained_share']:.0%} "
                   "of the tokens; always on), where Trainer projects every position onto the vocabulary (and its loop).")
        what = {"loss_chunk": "chunked loss in forward (never the logits)", "compile": "compiled decoder layers",
                "prefetch": "batches prefetched in a thread", "optim": f"AdamW {sides['optim']['flags'].get('optim_impl')} "
                                                                        "kernel instead of the backend's default"}
        for name, words in what.items():
            mem = (f"; peak memory {free['peak_memory_gb']:.2f} -> {sides[name]['peak_memory_gb']:.2f} GB"
                   if free["peak_memory_gb"] else "")
            kept = "kept" if all(summary["fast"].get(k) == v for k, v in sides[name]["flags"].items()) else "not kept"
            out.append(f"- {words}: x{sides[name]['gain']:.2f} over padding-free rows{mem} ({kept}).")
        if "trainer_random" in sides:
            out.append("- Trainer with and without length grouping, per target token: "
                       + compare_sides(summary, "trainer", "trainer_random", "grouped", "not grouped") + ".")
    compiled = "compiled by its own torch_compile" if summary.get("trainer_compiled") else "not compiled"
    out.append(f"- all kept ({', '.join(f'{k}={v}' for k, v in summary['fast'].items())}): x{summary['ratio']:.2f} "
               f"Trainer's ({compiled}) target tokens per second after the warm-up (the bar: x{summary['target']})"
               + (f"; end to end, the warm-up steps{' and their compilation' if summary.get('trainer_compiled') else ''} "
                  f"included, x{summary['ratio_end_to_end']:.2f}."
                  if "ratio_end_to_end" in summary else "."))
    return "\n".join(out)


def record(summary: dict, device) -> cl.Ledger:
    """The ledger build/results/bench_<shape>_<backend>.json: the figures (the report shows them) and the summary."""
    ledger = cl.Ledger(f"bench_{summary['shape']}_{summary['backend']}", profile="gpu" if device.type == "cuda" else "cpu",
                       quiet=True)  # in chapter 10's kernel its rows must not take over the chapter's tables
    ledger.data["bench"] = summary
    for name, side in summary["sides"].items():
        ledger.record(f"{name}_target_tokens_per_s", side["target_tokens_per_s"], "tokens/s",
                      note=f"median {side['median_step_s']:.2f} s/step after {side['warmup_steps']} warm-up steps")
        if "gain" in side:
            ledger.record(f"gain_{name}", side["gain"], "x", note=f"target tokens/s over recipe {side['vs']}")
    # timings of this machine (its cores, their load, native bf16 or not): observed beside a model, never asserted
    ledger.observe("recipe_vs_trainer_target_tokens_per_s", summary["ratio"], "x", predict=same_speed(summary),
                   note=f"recipe with {summary['fast']}; predicted: both sides process tokens equally fast, so the ratio "
                        f"of their trained shares (measured/predicted: processed tokens/s, recipe over Trainer); the "
                        f"bar: {summary['target']}x, {'met' if summary['ratio'] >= summary['target'] else 'not met'}")
    ledger.record("recipe_vs_trainer_end_to_end", summary["ratio_end_to_end"], "x",
                  note="target tokens over the seconds of every step, the warm-up"
                       + (" and its compilation" if summary.get("trainer_compiled") else "") + " included")
    ledger.observe("loss_diff_recipe_minus_trainer", summary["loss_diff"], "nats", predict=0.0,
                   note=f"mean loss over the last half of the steps; {'within' if summary['loss_within_noise'] else 'outside'}"
                        f" 2 standard errors of the two means ({summary['loss_noise']:.4f}); the two sides draw their "
                        "batches in different orders (Trainer groups by length)")
    return ledger


def compare_sides(summary: dict, a: str = "fast", b: str = "trainer", name_a: str = "the recipe",
                  name_b: str = "Trainer") -> str:
    """Two sides' seconds per target token, step by step, in one sentence whose word ("faster", "slower",
    "indistinguishable") comes from their spreads (`cl.timing.compare`, in µs per target token)."""
    sides = summary["sides"]
    if not all("s_per_target" in sides[k] for k in (a, b)):
        return f"{name_a} against {name_b}: no per-step times in this ledger (written before they were kept)"
    return cl.timing.compare(sides[a]["s_per_target"], sides[b]["s_per_target"], name_a, name_b, unit="µs")


def same_speed(summary: dict) -> float:
    """The recipe / Trainer ratio of target tokens per second if both processed tokens equally fast: the ratio of
    their trained shares (target tokens per processed token)."""
    share = {k: summary["sides"][k]["targets_per_step"] / summary["sides"][k]["processed_per_step"] for k in ("fast", "trainer")}
    return share["fast"] / share["trainer"]


# --- the loss mask's cost: `python -m course_lib.workbook.bench --masking` ------------------------------------------
def masking_chats(turns: int, n: int, seed: int = 0) -> list[list[dict]]:
    """`n` conversations of `turns` user/assistant exchanges each (the same shape, other words)."""
    rng = random.Random(seed)
    return [[m for t in range(turns) for m in ({"role": "user", "content": _words(rng, rng.randint(5, 40))},
                                               {"role": "assistant", "content": _words(rng, rng.randint(5, 40))})]
            for _ in range(n)]


def masking(turns=(1, 10, 40), n: int = 20, repeat: int = 5) -> dict:
    """The loss mask's cost per conversation under Qwen's shipped template (Qwen3's tokenizer), against rendering and
    tokenizing the conversation plainly (`apply_chat_template(tokenize=True)`): `template_mask` (one rendering; its
    shape's prefixes found once), the same with every conversation a shape of its own (the shapes forgotten before
    each), and `prefix_mask` (a rendering per assistant turn). Timed in turns (`cl.timing.interleaved`), `n`
    conversations a sample; returns {turns: {variant: Spread of seconds per conversation}} and prints each
    comparison with its ranges (`cl.timing.compare`)."""
    from transformers import AutoTokenizer

    from course_lib.sft import tokenizer as T

    tok = AutoTokenizer.from_pretrained(T.fetch_qwen_tokenizer())
    out = {}
    for k in turns:
        chats = masking_chats(k, n, seed=k)

        def cold():
            for c in chats:
                D._TEMPLATES.pop(tok, None)
                D.template_mask(tok, c)

        spreads = cl.timing.interleaved({
            "apply_chat_template": lambda: [tok.apply_chat_template(c, tokenize=True) for c in chats],
            "template_mask": lambda: [D.template_mask(tok, c) for c in chats],
            "template_mask, a new shape each": cold,
            "prefix_mask": lambda: [D.prefix_mask(tok, c) for c in chats]}, repeat=repeat)
        out[k] = {name: cl.timing.Spread([x / n for x in sp.samples]) for name, sp in spreads.items()}
        plain = out[k]["apply_chat_template"]
        print(f"{k} turn(s), {n} conversations a sample, per conversation:")
        for name in ("template_mask", "template_mask, a new shape each", "prefix_mask"):
            print("  " + cl.timing.compare(out[k][name], plain, name, "apply_chat_template", unit="ms")
                  + f"; ratio of medians {out[k][name].median / plain.median:.2f}")
    return out


def main(argv=None) -> dict:
    cl.env.deepspeed_told_no_gpu()
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--masking" in argv:  # (the flag is in --help below)
        return masking()
    p = argparse.ArgumentParser(description="The SFT recipe against HF Trainer, side by side (chapter 10).")
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--steps", type=int, help="optimizer steps per side (default: the shape's)")
    p.add_argument("--backend", choices=("single", "ddp", "fsdp"), default="single")
    p.add_argument("--nproc", type=int, default=2, help="ranks for ddp and fsdp")
    p.add_argument("--ablate", action="store_true", help="also the recipe without speed paths and with each alone")
    p.add_argument("--masking", action="store_true", help="instead: the loss mask's cost per conversation against a "
                                                          "plain apply_chat_template, at 1, 10 and 40 turns")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="neither side compiles (the recipe's layers, Trainer's torch_compile)")
    for flag, kind in (("--seq-len", int), ("--micro-batch", int), ("--accum", int), ("--lr", float), ("--skip", int),
                       ("--eval-n", int)):
        p.add_argument(flag, type=kind, help="default: the shape's" + (" (warm-up steps left out)" if flag == "--skip" else ""))
    args = vars(p.parse_args(argv))
    del args["masking"]
    summary = run(**args)
    print(table(summary))
    print(explain(summary))
    print(f"[bench] {summary['bench_seconds'] / 60:.1f} min; ledger: build/results/bench_{args['shape']}_{args['backend']}.json")
    print(json.dumps(summary, default=float))
    return summary


if __name__ == "__main__":
    main()
