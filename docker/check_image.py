"""Check the course image: `python docker/check_image.py` at build time, `--run` on its hardware.

The flavour (COURSE_FLAVOUR, which the Dockerfile sets from its FLAVOUR argument) says what must be there.
Build time (no GPU needed), both flavours: every requirement of pyproject.toml with the flavour's extra
(`gpu` or `cpu`) and `test` is installed at a version it allows; DeepSpeed was built for the flavour's
accelerator; the course kernel is registered.
- gpu: torch is a CUDA build and loads the NCCL and cuDNN it pins (see docker/requirements.py for why
  that can go wrong); DeepSpeed's ops are pre-compiled (no JIT build on first use); TensorFlow is built
  with CUDA.
- cpu: torch is the CPU build and no CUDA library came with anything (no `nvidia-*` package: PyPI's
  CUDA torch was not downloaded); TensorFlow is the CPU build.
With `--run` (the `test` and `check` entry points):
- gpu: torch and TensorFlow both see the GPU and run a convolution on it (cuDNN), NCCL answers, and
  DeepSpeed's fused Adam loads.
- cpu: torch and TensorFlow run a convolution on the CPU, and two gloo ranks all-reduce over the
  container's loopback (what the distributed chapters need).
- both: torch.compile builds and runs a kernel on that hardware (it needs a compiler in the image).
Prints one line per check and exits 1 naming whatever failed.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from requirements import COURSE_EXTRAS, requirements, torch_cuda_libs  # noqa: E402

PREBUILT_OPS = {"gpu": ("cpu_adam", "fused_adam", "async_io"), "cpu": ()}  # the chapters need none on CPU
ACCELERATOR = {"gpu": "cuda", "cpu": "cpu"}
KERNEL = "llm-course"
failures: list[str] = []


def check(what: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        failures.append(what)


def installed_matches_pyproject(flavour: str) -> None:
    from packaging.requirements import Requirement

    before = len(failures)
    for line in requirements([flavour, *COURSE_EXTRAS]):
        req = Requirement(line)
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            check(f"{req.name} installed", False, f"missing ({line})")
            continue
        public = version.split("+", 1)[0]  # deepspeed built here may carry a local version
        if not req.specifier.contains(public, prereleases=True):
            check(f"{req.name} version", False, f"{version} does not meet {line}")
    check(f"pyproject.toml's requirements ({flavour} and the course's extras) installed", len(failures) == before)


def torch_build(flavour: str) -> None:
    torch_cuda_build() if flavour == "gpu" else torch_cpu_build()


def torch_cuda_build() -> None:
    import torch

    check("torch is a CUDA build", torch.version.cuda is not None, f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    if torch.version.cuda is None:
        return
    for pin in torch_cuda_libs():
        name, want = pin.split("==")
        want = tuple(int(x) for x in want.split(".")[:3])
        try:
            if "nccl" in name:
                got = tuple(torch.cuda.nccl.version()[:3])
            else:
                v = torch.backends.cudnn.version()  # 9.20.0 -> 92000
                got = (v // 10000, v // 100 % 100, v % 100)
        except Exception as e:  # noqa: BLE001 - cannot query here: say so, do not guess
            print(f"warn could not query {name} without a GPU ({type(e).__name__}: {e})")
            continue
        want_cmp = want if "nccl" in name else want[:2]
        check(f"torch loads the {name} it pins", got[:len(want_cmp)] == want_cmp, f"loaded {got}, pinned {want}")


def torch_cpu_build() -> None:
    import torch

    check("torch is the CPU build", torch.version.cuda is None, f"torch {torch.__version__}")
    cuda_wheels = sorted(d.metadata["Name"] for d in metadata.distributions()
                         if (d.metadata["Name"] or "").lower().startswith("nvidia-"))
    check("no CUDA wheels installed", not cuda_wheels, ", ".join(cuda_wheels) or "none")


def deepspeed_ops(flavour: str) -> None:
    import deepspeed
    from deepspeed.git_version_info import accelerator_name, installed_ops

    built = {op for op, ok in installed_ops.items() if ok}
    want = PREBUILT_OPS[flavour]
    check(f"DeepSpeed ops pre-built ({', '.join(want) or 'none needed'})", set(want) <= built,
          f"deepspeed {deepspeed.__version__}; built: {', '.join(sorted(built)) or 'none'}")
    # ops built for another accelerator are not loaded (DeepSpeed falls back to a JIT build)
    check(f"DeepSpeed built for {ACCELERATOR[flavour]}", accelerator_name == ACCELERATOR[flavour],
          f"built for {accelerator_name!r}")


def tensorflow_build(flavour: str) -> None:
    import tensorflow as tf

    want = flavour == "gpu"
    check(f"TensorFlow built {'with' if want else 'without'} CUDA", tf.test.is_built_with_cuda() == want,
          f"tensorflow {tf.__version__}")


def kernel() -> None:
    from jupyter_client.kernelspec import KernelSpecManager

    specs = KernelSpecManager().find_kernel_specs()
    check(f"Jupyter kernel {KERNEL!r} registered", KERNEL in specs, str(specs.get(KERNEL, sorted(specs))))


def gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        check("torch sees a GPU", False, "none visible: start the container with GPUs (compose reserves them; "
              "`docker run --gpus all`), and check the host driver supports CUDA " + str(torch.version.cuda))
        return
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    cap = torch.cuda.get_device_capability(0)
    check("torch sees the GPUs", True, f"{len(names)} x {names[0]} (sm_{cap[0]}{cap[1]}), bf16 "
          f"{torch.cuda.is_bf16_supported()}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    conv = torch.nn.Conv2d(3, 8, 3).cuda()
    y = conv(torch.randn(2, 3, 16, 16, device="cuda"))
    check("torch convolution on the GPU (cuDNN)", tuple(y.shape) == (2, 8, 14, 14), f"cuDNN {torch.backends.cudnn.version()}")

    from deepspeed.ops.op_builder import FusedAdamBuilder

    FusedAdamBuilder().load()
    check("DeepSpeed fused Adam loads (pre-built)", True)

    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    check("TensorFlow sees the GPUs", bool(gpus), f"{len(gpus)} GPU(s)")
    if gpus:
        for g in gpus:
            tf.config.experimental.set_memory_growth(g, True)  # leave the memory to torch
        with tf.device("/GPU:0"):
            out = tf.keras.layers.Conv2D(8, 3)(tf.random.normal((2, 16, 16, 3)))
        check("TensorFlow convolution on the GPU (cuDNN)", tuple(out.shape) == (2, 14, 14, 8))


def compiles(device: str) -> None:
    """torch.compile builds a kernel: Inductor needs a C++ compiler on the CPU, Triton a C compiler on the GPU."""
    import torch

    def gelu2(x):
        return torch.nn.functional.gelu(x) * 2

    x = torch.randn(256, device=device)
    y = torch.compile(gelu2)(x)
    check(f"torch.compile builds and runs a kernel on the {device.upper()}", bool(torch.allclose(y, gelu2(x), atol=1e-5)))


def _all_reduce(rank: int, port: int, world: int) -> None:
    """One gloo rank of cpu(): all-reduce rank+1 over the loopback; exits non-zero on a wrong sum."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    x = torch.full((1 << 20,), rank + 1.0)
    dist.all_reduce(x)
    dist.destroy_process_group()
    if not bool((x == world * (world + 1) / 2).all()):
        raise SystemExit(f"rank {rank}: wrong all-reduce sum {x[0].item()}")


def cpu() -> None:
    import torch

    torch.set_num_threads(1)
    y = torch.nn.Conv2d(3, 8, 3)(torch.randn(2, 3, 16, 16))
    check("torch convolution on the CPU", tuple(y.shape) == (2, 8, 14, 14), f"{os.cpu_count()} CPU(s) visible")

    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_all_reduce, args=(port, 2), nprocs=2, join=True)  # raises if a rank failed
    check("two gloo ranks all-reduce over the loopback", True, "4 MiB each")

    from deepspeed.accelerator import get_accelerator

    check("DeepSpeed runs on the CPU accelerator", get_accelerator().device_name() == "cpu",
          get_accelerator().device_name())

    import tensorflow as tf

    out = tf.keras.layers.Conv2D(8, 3)(tf.random.normal((2, 16, 16, 3)))
    check("TensorFlow convolution on the CPU", tuple(out.shape) == (2, 14, 14, 8),
          f"{len(tf.config.list_physical_devices('CPU'))} CPU device(s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavour", choices=sorted(ACCELERATOR), default=os.environ.get("COURSE_FLAVOUR", "gpu"),
                        help="what the image must contain (default: $COURSE_FLAVOUR, else gpu)")
    parser.add_argument("--run", action="store_true", help="also run on the flavour's hardware: the GPU(s), or the CPU")
    args = parser.parse_args(argv)
    print(f"checking the {args.flavour} image", flush=True)
    per_flavour = [installed_matches_pyproject, torch_build, deepspeed_ops, tensorflow_build]
    calls = [(step, (args.flavour,)) for step in per_flavour] + [(kernel, ())]
    if args.run:
        calls += [({"gpu": gpu, "cpu": cpu}[args.flavour], ()), (compiles, (ACCELERATOR[args.flavour],))]
    for step, step_args in calls:
        try:
            step(*step_args)
        except Exception as e:  # noqa: BLE001 - report every check, then fail once (a failed rank: mp's error)
            check(step.__name__, False, f"{type(e).__name__}: {e}")
    if failures:
        print(f"image check failed: {', '.join(failures)}", file=sys.stderr)
        return 1
    print("image check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
