"""Check the course image: `python docker/check_image.py` at build time, `--gpu` when a GPU is attached.

Build time (no GPU needed): every requirement of pyproject.toml (with the gpu and test extras) is
installed at a version it allows; torch is a CUDA build and loads the NCCL and cuDNN it pins (see
docker/requirements.py for why that can go wrong); DeepSpeed's ops are pre-compiled (no JIT build
on first use); TensorFlow is built with CUDA; the course kernel is registered.
With `--gpu` (the `test` and `check` entry points): torch and TensorFlow both see the GPU and run
a convolution on it (cuDNN), NCCL answers, and DeepSpeed's fused Adam loads.
Prints one line per check and exits 1 naming whatever failed.
"""
from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from requirements import requirements, torch_cuda_libs  # noqa: E402

PREBUILT_OPS = ("cpu_adam", "fused_adam", "async_io")
KERNEL = "llm-course"
failures: list[str] = []


def check(what: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        failures.append(what)


def installed_matches_pyproject() -> None:
    from packaging.requirements import Requirement

    before = len(failures)
    for line in requirements(["gpu", "test"]):
        req = Requirement(line)
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            check(f"{req.name} installed", False, f"missing ({line})")
            continue
        public = version.split("+", 1)[0]  # deepspeed built here may carry a local version
        if not req.specifier.contains(public, prereleases=True):
            check(f"{req.name} version", False, f"{version} does not meet {line}")
    check("pyproject.toml's requirements (gpu, test extras) installed", len(failures) == before)


def torch_libs() -> None:
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


def deepspeed_ops() -> None:
    import deepspeed
    from deepspeed.git_version_info import accelerator_name, installed_ops

    built = {op for op, ok in installed_ops.items() if ok}
    check("DeepSpeed ops pre-built", set(PREBUILT_OPS) <= built,
          f"deepspeed {deepspeed.__version__}; built: {', '.join(sorted(built)) or 'none'}")
    # ops built for another accelerator are not loaded (DeepSpeed falls back to a JIT build)
    check("DeepSpeed ops built for CUDA", accelerator_name == "cuda", f"built for {accelerator_name!r}")


def tensorflow_cuda() -> None:
    import tensorflow as tf

    check("TensorFlow built with CUDA", tf.test.is_built_with_cuda(), f"tensorflow {tf.__version__}")


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="also check the attached GPU(s)")
    args = parser.parse_args(argv)
    steps = [installed_matches_pyproject, torch_libs, deepspeed_ops, tensorflow_cuda, kernel] + ([gpu] if args.gpu else [])
    for step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - report every check, then fail once
            check(step.__name__, False, f"{type(e).__name__}: {e}")
    if failures:
        print(f"image check failed: {', '.join(failures)}", file=sys.stderr)
        return 1
    print("image check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
