"""Presets: the sizes each profile runs at, as plain data (in the spirit of nanoGPT's configs).

A notebook's `parameters` cell names a profile (and may override single knobs); it then calls

    P = cl.preset(profile, chapter="03", steps=steps)    # None means "take the preset's value"
    cl.setup(P)                                          # the kernel prepared for it (GPUs hidden, TF32, ...)

and reads `P.model`, `P.seq_len`, `P.steps`, ... `preset` only returns values; `setup` is the one place that
changes the kernel. The `cpu` profile runs on a 2-core laptop or CI
runner in minutes; `gpu` uses real sizes on one modern GPU (the Docker image, chapter README).
A knob enters once, here or in the parameters cell, and travels one way from there.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

from .env import CPU_PROFILE_ENV, cuda_count, resolve_nproc
from .models import QWEN25, TINY

PRESETS = {
    "cpu": {
        "device": "cpu",
        "nproc": 2,  # ranks for distributed chapters (gloo)
        "tf32": False,  # no effect on a CPU
        "model": TINY,
        "seq_len": 128,
        "batch_size": 8,
        "seed": 0,
        "chapters": {
            "00": dict(act_seq_len=256, act_batch=4),
            "01": dict(steps=12, train_batch=4, train_seq=64, growth_interval=2, overflow_step=6, matmul_n=256,
                       lr=3e-3, threads=1),  # 1 thread: tiny ops gain nothing from 2, and stay sane under load
            "02": dict(samples=8192, test_samples=16384, epochs=3, width=128, batch=256, seeds=1, spread_seeds=3,
                       loop_steps=40, growth_steps=5, overflow_step=25, threads=1),
            # timeline_vocab 3072: the tiny body's activations per token ≈ 4.4 × its logits, Qwen2.5-0.5B's ratio
            # sweep_model's 256 words: the loss's spike (3 x tokens x vocabulary x 4 B: 3 MiB) stays below one layer's
            # activations (6.3 MiB), so k* shows (section 5); with the tiny model's 1,024 words it is 12 MiB
            "03": dict(time_repeat=3, chain_len=64, chain_numel=2**18,
                       sweep_model=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=16, vocab_size=256),
                       tf_blocks=8, tf_width=32, tf_batch=65536,
                       timeline_vocab=3072, ce_vocab=151936, ce_tokens=512, ce_chunk=64,
                       opt_steps=40, opt_seeds=3, opt_batch=4, opt_seq=64, opt_lr=3e-3),
            "04": dict(steps=40, accum_steps=4, lr=3e-3, warmup_steps=5, min_lr_ratio=0.1, max_grad_norm=5.0,
                       spike_step=25, spike_factor=1000.0, scale_steps=20, task_vocab=None),  # None: all 1,024 words
            "05": dict(steps=4, micro_batch=4, seq_len=64, accum=2, bucket_mb=0.25, repeat=5, atol=1e-6,
                       tf_batch=64,
                       # communication: sweep 1 KiB..4 MiB (the tiny model's gradients are 4.5 MB), three bucket caps
                       sweep_sizes=tuple(2**k for k in range(10, 23, 2)), sweep_repeat=10,
                       comm_buckets=(0.05, 0.5, 25.0), comm_repeat=6),
            "06": dict(steps=3, micro_batch=2, accum=2, seq_len=64, lr=1e-3, save_at=1,
                       persistence_threshold=0),  # 0: partition even the tiny model's small tensors (ZeRO-3)
            "07": dict(steps=4, micro_batch=4, prefetch_repeat=5),
            "08": dict(micro_batches=(1, 2, 4, 8), micro_batch=4, pp_model=dict(num_hidden_layers=8, vocab_size=256),
                       # 5 timed repeats each: two equal variants separate by chance in under 1% of runs (3: 10%)
                       pp_repeat=5, tp_meshes=None, tp_repeat=5),
            # 09-10: a 2-layer Qwen2 and a digit task it learns in minutes ("Reverse 5677693" -> "3967765")
            "09": dict(sft_model=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512),
                       n_train=4000, n_eval=200, seq_len=64, micro_batch=32, threads=1,
                       pre_steps=150, pre_lr=1e-3, steps=200, lora_r=16, lora_alpha=32, lora_dropout=0.05, lr=3e-3,
                       em_bound=0.85),
            "10": dict(sft_model=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512),
                       n_train=4000, n_eval=200, seq_len=64, micro_batch=16, threads=1,  # micro_batch: per rank
                       steps=300, lr=1e-3, precision="fp32", save_every=100, resume_at=200, resume_steps=20,
                       compare_steps=24, em_bound=0.8,  # 19 timed: 12 (7 timed) read 1.1-1.6x from run to run
                       # section 6: fast vs Trainer only. Each change alone (9 runs, 130 s here) says little at the
                       # tiny shape; `make bench BENCH=--ablate` measures it at the real one. Neither side compiles:
                       # on 2 cores compiling Trainer's whole tiny model took 53-86 s, the 24 steps ~10
                       bench_ablate=False, bench_compile=False),
            # 11: the grid on a 4-layer Qwen2 (1.0M parameters), one core per rank (as one GPU per rank); "fit" =
            # within a made-up device of half the bytes per rank the fp32 baseline measured (the source article's "fp32: OOM")
            "11": dict(sft_model=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=512),
                       n_train=400, steps=6, micro_batch=8, seq_len=64, accum_split=4, lora_r=8, lr=1e-3, threads=1,
                       budget_fraction=0.5),
            "12": dict(steps=3, threads=1, io_slowdown=3.0, io_workers=4, quant_train_steps=150, quant_eval=64,
                       comm_steps=20, comm_micro_batch=2, comm_seq_len=32,
                       comm_model=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, vocab_size=512),
                       # the step's split (section 3): narrow = 8 tokens a step, AdamW's ~80 B per parameter against
                       # the matmuls' 6 x 8 FLOP per weight (the untied 32k x 64 input table: AdamW only); wide = 1024
                       # tokens a step (8 x P.seq_len 128), 6144 FLOP per weight
                       narrow_model=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=False),
                       narrow_seq=8, narrow_batch=1,
                       wide_model=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
                                       num_key_value_heads=4, num_hidden_layers=1), wide_batch=8),
        },
    },
    "gpu": {
        "device": "cuda",
        "nproc": "all",  # every visible GPU; on one GPU the multi-rank parts run as CPU ranks (`ranks_plan`)
        "tf32": True,  # float32 matmuls on the tensor cores (TF32), except where fp32 precision is the lesson (01)
        "model": QWEN25["Qwen2.5-0.5B"],  # random init (chapters 09-10 load real weights from `model_path`)
        "seq_len": 1024,
        "batch_size": 8,
        "seed": 0,
        "chapters": {
            "00": dict(act_seq_len=1024, act_batch=4),
            "01": dict(steps=24, train_batch=8, train_seq=1024, growth_interval=4, overflow_step=12, matmul_n=4096,
                       lr=5e-4, threads=None, tf32=False),  # None: all cores; steps as the cpu profile's, doubled
            "02": dict(samples=131072, test_samples=65536, epochs=4, width=2048, batch=1024, seeds=3, spread_seeds=3,
                       loop_steps=60, growth_steps=8, overflow_step=36, threads=None),
            "03": dict(time_repeat=3, chain_len=256, chain_numel=2**24,
                       # the 24 layers of Qwen2.5-0.5B with 8,192 words: the loss's spike (3 x tokens x vocabulary x
                       # 4 B: 0.8 GB) stays below one layer's activations (1.4 GB), so k* shows (section 5); with
                       # 151,936 words it is 14.9 GB, ten layers' worth, and the lowest peak moves to 8-layer segments
                       sweep_model=dict(vocab_size=8192),
                       tf_blocks=8, tf_width=64, tf_batch=131072,
                       timeline_vocab=None,  # None: the model's own 151,936 words
                       ce_vocab=151936, ce_tokens=8192, ce_chunk=1024,
                       opt_steps=40, opt_seeds=3, opt_batch=8, opt_seq=256, opt_lr=1e-3),
            # task_vocab: the permutation over 1,024 of the 151,936 words, a task 60 steps can learn
            "04": dict(steps=60, accum_steps=4, lr=3e-4, warmup_steps=6, min_lr_ratio=0.1, max_grad_norm=1.0,
                       spike_step=36, spike_factor=1000.0, scale_steps=20, task_vocab=1024),
            "05": dict(steps=10, micro_batch=2, seq_len=512, accum=4, bucket_mb=25.0, repeat=10, atol=1e-4,
                       tf_batch=256, sweep_sizes=tuple(2**k for k in range(12, 29, 2)), sweep_repeat=10,
                       comm_buckets=(1.0, 25.0, 100.0), comm_repeat=10),
            "06": dict(steps=10, micro_batch=4, accum=2, seq_len=1024, lr=1e-5, save_at=5,
                       persistence_threshold=None),  # None: the config's "auto" (10 x hidden size)
            "07": dict(steps=10, micro_batch=4, prefetch_repeat=5),
            # 08's pipeline: the profile's layers, a small vocabulary (the 152k one would keep ~40 GB of fp32 logits
            # on the last stage at 16 x 4 x 1024 tokens)
            "08": dict(micro_batches=(1, 2, 4, 8, 16), micro_batch=4, pp_model=dict(vocab_size=8192),
                       pp_repeat=5, tp_meshes=None, tp_repeat=5),
            # 09-10 fine-tune a real Qwen2.5 when `model_path` is given; else a random-init model of this size
            "09": dict(sft_model=dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, intermediate_size=2048),
                       n_train=20000, n_eval=500, seq_len=64, micro_batch=64, threads=None,
                       pre_steps=500, pre_lr=5e-4, steps=500, lora_r=16, lora_alpha=32, lora_dropout=0.05, lr=1e-3,
                       em_bound=0.9),
            "10": dict(sft_model=dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, intermediate_size=2048),
                       n_train=20000, n_eval=500, seq_len=64, micro_batch=64, threads=None,
                       steps=1000, lr=3e-4, precision="auto", save_every=250, resume_at=500, resume_steps=50,
                       compare_steps=50, em_bound=0.8,
                       bench_ablate=False, bench_compile=True),  # 9 runs at 0.5B: ~3 of the GPU run's minutes: make bench
            # 11: a Qwen2.5-1.5B-shaped model (random init; or `model_path`); "fit" = no out-of-memory on the device
            "11": dict(sft_model=dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                      intermediate_size=8960),
                       n_train=4000, steps=10, micro_batch=8, seq_len=1024, accum_split=4, lora_r=16, lr=1e-4, threads=None,
                       budget_fraction=None),
            "12": dict(steps=5, threads=None, io_slowdown=3.0, io_workers=4, quant_train_steps=150, quant_eval=200,
                       comm_steps=50, comm_micro_batch=2, comm_seq_len=32,  # (the heads: 64 / 14 is no head size)
                       comm_model=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, vocab_size=512,
                                       num_attention_heads=4, num_key_value_heads=2),
                       narrow_model=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=False),
                       narrow_seq=8, narrow_batch=1,
                       wide_model=dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                                       num_key_value_heads=4, num_hidden_layers=4, vocab_size=32000), wide_batch=8),
        },
    },
}

# On one GPU (ranks_plan: the multi-rank parts as CPU gloo ranks at the cpu sizes) these chapters' work is their
# CPU ranks' (plus calculators and TensorFlow on the CPU; the kernel touches the GPU for a small check at most): the
# runner's --jobs 2 with the gpu profile runs one of them beside the chapter on the GPU (tools/gpu_run.py does).
CPU_RANK_CHAPTERS = ("05", "06", "08")

# The gpu profile's time on one H200, per chapter, in seconds (tools/gpu_run.py plans its commands on them and stops a
# chapter at twice its figure, at least 60 s). 01, 03, 04: measured there. 05, 06, 08: measured on the cpu profile on
# a 2-core machine: on one GPU their work is their CPU ranks' at the cpu sizes, one thread a rank as there (the kernel
# beside them on its own cores). The rest DERIVED, not measured (replace each by the first run's wall time).
# Assumed: kernel start and imports 12 s a chapter (torch + transformers import in 8-9 s on a 2-vCPU Xeon,
# matplotlib 1 s, CUDA start-up); random init on the GPU 2 s at 0.5B, 3 s at 1.5B
# (cl.models.INIT_DEVICE; on a CPU it is 13 s at 0.5B whatever the thread count, measured: the generator is serial),
# once (cl.models.tiny_qwen2 copies it after, 1.5 s); a launch of 2 CPU gloo ranks at the cpu sizes 15-20 s (start-up,
# as measured on 2 cores); training 6Ψ FLOPs a token (Ψ = 0.494e9) at 30% of 989 TFLOP/s (bf16) or
# 494 (TF32), 50% of 67 (fp32 without TF32). An estimate to plan a first run with, not a check: nothing asserts it.
GPU_SECONDS = {
    "00": (22, "12 kernel + 2 build + a few 4-8k-token passes (< 1 s each) + the calculator"),
    "01": (71, "measured on one H200 (torch 2.11): 70.5 s"),
    "02": (56, "12 + TensorFlow and Keras import 6 (both ahead: runner.WARM_MORE) + 12 fits x 4 epochs x 128 batches x"
               " ~3 ms Keras overhead = 18 s + loops, timing 20"),
    "03": (142, "measured on one H200 (torch 2.11): 141.5 s, with the sweep at the full vocabulary"),
    "04": (50, "measured on one H200 (torch 2.11): 49.9 s"),
    "05": (61, "the cpu profile's wall time on 2 cores: 61 s (its launches at cpu sizes and TensorFlow on the CPU)"),
    "06": (134, "the cpu profile's wall time on 2 cores: 134 s (its launches at cpu sizes, the estimators)"),
    "07": (51, "the cpu profile's wall time on 2 cores 36 s (its launch at cpu sizes) + a 0.5B build 2 + its one-rank"
               " FSDP2 demo 3 + a 2 GB save_pretrained and its reload from rank 0 10"),
    "08": (57, "the cpu profile's wall time on 2 cores: 57 s (its launches at cpu sizes, TF DTensor on the CPU)"),
    "09": (45, "12 + 1000 steps of a 25M model at 4k tokens (~15 ms) + exact-match generation"),
    "10": (300, "on one H200 (torch 2.11) the launch of section 3 took 90 s (1000 steps: 62 s) and the chapter was"
                " stopped at 200 s inside section 6's benchmark: 300 s until a whole run says more"),
    "11": (57, "12 + the distributed rows' fp32 reference at cpu sizes on the CPU 3 (section 1; with bf16 beside"
               " it 6.1 s on 2 cores) + max(their one launch of 2 CPU ranks, in the background: 20 + 7 configurations"
               " 22 = 42, the GPU's work beside it: a 1.5B build 3 and its checkpoint 5 + single rows 6 loads x 3 +"
               " 6 x 10 steps x 8192 tok x 9.2e9 / 297e12 = 15 s, 41) = 42"),
    "12": (75, "12 + two launches 30 + profiler steps + 3 quantized loads and steps 15"),
}


def detect_profile() -> str:
    """`gpu` when CUDA is available, else `cpu` (what `profile="auto"` resolves to)."""
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def preset(profile: str = "auto", chapter: str | None = None, **overrides) -> SimpleNamespace:
    """The settings of `profile` (plus one chapter's block), with non-None `overrides` applied: values only,
    nothing in this process changes (`setup(P)` prepares the kernel for them)."""
    name = detect_profile() if profile == "auto" else profile
    if name not in PRESETS:
        raise ValueError(f"unknown profile {profile!r}: choose one of auto, {', '.join(PRESETS)}")
    base = {k: v for k, v in PRESETS[name].items() if k != "chapters"}
    if chapter is not None:
        chapters = PRESETS[name]["chapters"]
        if chapter not in chapters:
            raise ValueError(f"no preset for chapter {chapter!r}: known chapters are {', '.join(chapters)}")
        base.update(chapters[chapter])
    for key, value in overrides.items():
        if key not in base:
            raise ValueError(f"unknown knob {key!r} for profile {name!r}: known knobs are {', '.join(sorted(base))}")
        if value is not None:
            base[key] = value
    base["nproc"] = resolve_nproc(base["nproc"])
    base["model"] = dict(base["model"])
    return SimpleNamespace(name=name, chapter=chapter, **base)


def setup(P: SimpleNamespace) -> None:
    """Prepare this kernel for the preset `P`, in the open (each chapter calls it after `preset`). The cpu profile
    hides every GPU from the kernel and from what it launches (`env.CPU_PROFILE_ENV`, what the runner gives its
    kernels), so `profile="cpu"` in JupyterLab on a GPU machine runs as it does in CI. The gpu profile sets TF32
    for float32 matmuls, draws random init on the GPU and keeps the last model built (one random 0.5B build a
    chapter: `cl.models`)."""
    if P.name == "cpu":
        os.environ.update(CPU_PROFILE_ENV)
    if P.device == "cuda":  # TF32 on or off for this kernel's float32 matmuls, decided here
        import torch

        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(P.tf32)
        from course_lib import models

        models.KEEP_LAST_BUILT, models.INIT_DEVICE = True, os.environ.get("COURSE_INIT_DEVICE", "cuda")


# The variable that hides every GPU from a launched rank (its torch then sees none: gloo, CPU tensors).
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}


def ranks_plan(P: SimpleNamespace) -> SimpleNamespace:
    """Where a chapter's multi-rank parts run (chapters 05-08, 11 and 12; introduced in chapter 05): the one place
    that decides it. Returns `nproc`, `device`, `backend`, `env` (for `cl.launch`), `P` (the preset the launched
    recipe takes its sizes from) and `reason`, the line the notebook prints.

    One rank per GPU when the profile runs on 2+ GPUs (NCCL); on the CPU profile the preset's gloo ranks. On a
    single GPU, NCCL cannot put two ranks on one device and a sharding factor of 1 shows nothing, so the
    multi-rank parts run as the cpu profile's gloo ranks at the cpu profile's sizes, GPUs hidden from the ranks,
    while the chapter's single-process parts stay on the GPU at the real sizes. Every plan has 2+ ranks."""
    if P.device == "cpu":
        hide = dict(CPU_PROFILE_ENV) if P.name == "cpu" else {}
        plan = dict(nproc=P.nproc, device="cpu", backend="gloo", env=hide, P=P,
                    reason=f"{P.nproc} gloo ranks on the CPU, one core each, at the {P.name} profile's sizes")
    elif cuda_count() >= 2 and P.nproc >= 2:
        plan = dict(nproc=min(P.nproc, cuda_count()), device="cuda", backend="nccl", env={}, P=P,
                    reason=f"{min(P.nproc, cuda_count())} NCCL ranks, one GPU each, at the {P.name} profile's sizes")
    else:
        small = preset("cpu", chapter=getattr(P, "chapter", None))  # sizes only: the kernel keeps its GPU
        plan = dict(nproc=small.nproc, device="cpu", backend="gloo", env=dict(HIDE_GPUS), P=small,
                    reason=f"{cuda_count()} GPU visible and NCCL needs one GPU per rank: the multi-rank parts run as "
                           f"{small.nproc} gloo ranks on the CPU at the cpu profile's sizes (GPUs hidden from them); "
                           f"the single-process parts run on the GPU at the {P.name} profile's sizes")
    if plan["nproc"] < 2:
        raise ValueError(f"{plan['nproc']} rank: the multi-rank parts need 2 or more ({plan['reason']})")
    return SimpleNamespace(**plan)
