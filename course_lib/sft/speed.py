"""The SFT recipe's speed paths: each a flag of course_lib/recipes/sft.py, each measured alone by the benchmark
(`python -m course_lib.workbook.bench`, chapter 10 section 6), each keeping the plain path's loss and gradients
(tests/test_speed.py states the tolerance of each):

    --padding-free     each micro-batch's examples joined into one row, no padding (`cl.data.flatten`)
    --loss-chunk N     the loss inside the model's forward, over the trained positions only, N tokens at a time,
                       never the (tokens x vocabulary) logits (`loss_in_forward`, `cl.losses.chunked_cross_entropy`)
    --compile          every decoder layer through `torch.compile` (`compile_layers`)
    --prefetch         the next step's batches made in a background thread (`Prefetcher`)
    --optim-impl K     AdamW's kernel: fused, foreach or a plain loop (`adamw_kernel`)

Rank-side: the recipe applies them (`apply`) before its backend wraps the model, so DDP, FSDP2 and DeepSpeed see
a model that already computes its loss in its forward and already has compiled layers.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from ..memory.losses import IGNORE_INDEX, chunked_cross_entropy

OPTIM_IMPLS = ("auto", "fused", "foreach", "forloop")


class LossInForward:
    """A causal LM whose forward can return the SFT loss itself: `model(**batch, loss_chunk=N).loss`.

    Without `loss_chunk` it is the model's own forward (generation, `model(**batch).loss`). With it: the decoder's
    hidden states, kept only where a label follows (position p predicts token p + 1), then the LM head and the
    cross-entropy N tokens at a time (`chunked_cross_entropy`): the same mean loss over the target tokens.
    Inside the forward, the output embedding's weight is used while the wrapper holds it: gathered by FSDP2 (the
    root's parameters stay unsharded through its forward), fetched by ZeRO-3 (registered as an external parameter
    of the root, `course_lib.sft.backends.DeepSpeed`), and its gradient reduced with the rest by DDP."""

    def forward(self, input_ids=None, labels=None, loss_chunk: int = 0, **kwargs):
        if not loss_chunk or labels is None:
            return super().forward(input_ids=input_ids, labels=labels, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = self.get_decoder()(input_ids=input_ids, **kwargs).last_hidden_state
        targets = labels[:, 1:]
        keep = targets != IGNORE_INDEX
        loss = chunked_cross_entropy(hidden[:, :-1][keep], self.get_output_embeddings().weight, targets[keep],
                                     chunk=loss_chunk)
        return CausalLMOutputWithPast(loss=loss)


def loss_in_forward(model):
    """Give `model` (a transformers causal LM, or a peft model around one) the `LossInForward` forward, in place:
    its class becomes a subclass of its own class of the same name (what `fully_shard` does to a module too), so
    its weights, state dict, `save_pretrained` and `generate` stay as they were."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cls = type(base)
    if not issubclass(cls, LossInForward):
        base.__class__ = type(cls.__name__, (LossInForward, cls), {"__module__": cls.__module__})
    return model


def decoder_layers(model) -> torch.nn.ModuleList:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder().layers


def compile_layers(model, dynamic: bool = True):
    """`torch.compile` each decoder layer in place (`Module.compile`: the state dict keeps its names), with
    dynamic shapes: the batch's length changes from step to step, so one graph serves them all instead of a
    recompilation per length. The layers share their code, so one compilation serves every layer. The first
    step pays the compilation (the benchmark counts it as warm-up and reports it)."""
    for layer in decoder_layers(model):
        layer.compile(dynamic=dynamic)
    return model


def eager():
    """Compiled layers run uncompiled inside this context (`torch.compiler.set_stance("force_eager")`). The recipe
    evaluates and generates in it: a no-grad forward would compile the layers once more, and generation's KV cache,
    which changes state every token, would recompile them eight times before torch gives up (~1 s each on a CPU)."""
    return torch.compiler.set_stance("force_eager")


def apply(model, cfg):
    """The model-side speed paths `cfg` asks for (`loss_chunk`, `compile`), before a backend wraps the model."""
    if getattr(cfg, "loss_chunk", 0):
        loss_in_forward(model)
    if getattr(cfg, "compile", False):
        compile_layers(model)
    return model


def check(cfg) -> None:
    """One-line `ConfigError`s for speed flags that cannot work (the recipe's `Config.check` calls it)."""
    from ..config import ConfigError

    if getattr(cfg, "optim_impl", "auto") not in OPTIM_IMPLS:
        raise ConfigError(f"--optim-impl must be one of {', '.join(OPTIM_IMPLS)}, got {cfg.optim_impl!r}")
    if getattr(cfg, "loss_chunk", 0) < 0:
        raise ConfigError(f"--loss-chunk must be >= 0 (0: off), got {cfg.loss_chunk}")
    if getattr(cfg, "compile", False) and getattr(cfg, "deepspeed", None):
        raise ConfigError("--compile is for one process, DDP and FSDP2 (DeepSpeed compiles its own way)")


def adamw_kernel(cfg, default: str) -> dict:
    """`torch.optim.AdamW`'s keyword for the kernel `cfg.optim_impl` names (`auto`: the backend's `default`):
    fused (one kernel per parameter tensor), foreach (a few ops over lists of tensors) or forloop (~10 ops per
    tensor, the reference)."""
    impl = getattr(cfg, "optim_impl", "auto")
    impl = default if impl == "auto" else impl
    return {"fused": {"fused": True}, "foreach": {"foreach": True, "fused": False},
            "forloop": {"foreach": False, "fused": False}}[impl]


class Prefetcher:
    """`make(step)` for each step in `steps`, in order, each made while the previous step trains: one background
    thread keeps one step ahead (`ahead=False`: each made when asked, no thread). `make` must not call collectives
    (the ranks' threads would race). Use it in a `with` block: leaving it, also when a step raises, ends the thread."""

    def __init__(self, make, steps, ahead: bool = True):
        self.make, self.steps = make, iter(steps)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch") if ahead else None
        self.ahead = self._submit() if ahead else None

    def _submit(self):
        step = next(self.steps, None)
        return None if step is None else self.pool.submit(self.make, step)

    def __iter__(self):
        return self

    def __next__(self):
        if self.pool is None:
            return self.make(next(self.steps))
        if self.ahead is None:
            self.close()
            raise StopIteration
        current, self.ahead = self.ahead, self._submit()
        return current.result()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
