"""Checkpoints that an interrupted save cannot destroy: sharded (DCP) for FSDP2, full for a plain model.

Chapter 07 explains them; the SFT recipe and the capstone reuse them.

- `atomic_directory(path)`: write a checkpoint into a temporary sibling (`<path>.tmp`), mark it
  complete, and only then swap it in. The last good checkpoint stays on disk until the new one is
  complete, so a crash (or a Ctrl-C, or a killed job) at any moment leaves one that loads.
- `resolve(path)`: the checkpoint to load: `path`, or `<path>.prev` when a crash hit between the two
  renames of the swap; None when there is no complete checkpoint.
- `save_sharded` / `load_sharded`: model + optimizer with `torch.distributed.checkpoint` (DCP): every
  rank writes its own shards in parallel; `get_state_dict` / `set_state_dict` translate between
  FSDP2's sharded DTensors and the checkpoint's names. A DCP checkpoint loads on another number of
  ranks (or into one unsharded model): it stores each tensor's global shape and where each piece goes.
  Only what trains is saved: a frozen weight (LoRA's base) is the model's as it was loaded.
- `full_state_dict(model)` / `save_full(path, model)`: gather the unsharded weights on rank 0 (on
  the CPU), e.g. to hand a plain Hugging Face model to inference; with `source`, written as that checkpoint
  is (`save_pretrained`: its tensor names, its `use_cache`, its generation_config.json).

Every function works in one process too (no process group): then rank 0 is the only rank.
"""
from __future__ import annotations

import json
import logging
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

MARKER = "checkpoint.json"  # written last, by rank 0: its presence means "complete"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def is_complete(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def resolve(path: str | Path) -> Path | None:
    """The complete checkpoint at `path`, else the previous one a crashed swap left at `<path>.prev`."""
    path = Path(path)
    for candidate in (path, _sibling(path, ".prev")):
        if is_complete(candidate):
            return candidate
    return None


def complete(directory: str | Path, prefix: str = "checkpoint-") -> list[Path]:
    """The complete checkpoints `<directory>/<prefix>NNNNNN`, oldest first (names sort by step), each as `resolve`
    finds it: `<name>.prev` where a crash in a swap left only that; never a `.tmp`."""
    names = sorted({p.name.split(".")[0] for p in Path(directory).glob(prefix + "*") if p.is_dir()})
    found = [resolve(Path(directory) / name) for name in names]
    return [p for p in found if p is not None]


def latest(directory: str | Path, prefix: str = "checkpoint-") -> Path | None:
    """The newest complete checkpoint `<directory>/<prefix>NNNNNN`, or None."""
    done = complete(directory, prefix)
    return done[-1] if done else None


def keep_newest(directory: str | Path, n: int | None, prefix: str = "checkpoint-", run: str | None = None,
                keep_best: bool = False) -> None:
    """Delete all but the `n` newest complete checkpoints (None or 0: keep all), and with `keep_best` the one whose
    recorded `eval_loss` is the lowest (`best`). With `run`, only the checkpoints whose metadata names that run count:
    another run's in the same directory are neither kept nor deleted. Call on one rank, after a save."""
    if not n:
        return
    done = complete(directory, prefix)
    if run is not None:
        done = [p for p in done if _run_of(p) == run]
    kept = best(directory, prefix, run) if keep_best else None
    for old in done[:-n]:
        if old == kept:
            continue
        (old / MARKER).unlink()  # first: a deletion cut short leaves no "complete" checkpoint with missing shards
        shutil.rmtree(old)


def best(directory: str | Path, prefix: str = "checkpoint-", run: str | None = None) -> Path | None:
    """The complete checkpoint (of `run`, if given) with the lowest recorded `eval_loss`, the earliest on a tie; None
    if none records one."""
    scored = []
    for path in complete(directory, prefix):
        try:
            meta = read_meta(path)
        except (OSError, ValueError):
            continue
        if (run is None or meta.get("run") == run) and isinstance(meta.get("eval_loss"), (int, float)):
            scored.append((meta["eval_loss"], path))
    return min(scored, key=lambda t: t[0])[1] if scored else None


def _run_of(path: Path) -> str | None:
    try:
        return read_meta(path).get("run")
    except (OSError, ValueError, AttributeError):
        return None


def read_meta(path: str | Path) -> dict:
    """The metadata saved with a checkpoint (step, loss, ...), from whichever copy `resolve` picks."""
    found = resolve(path)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint at {path} (nor {_sibling(Path(path), '.prev')})")
    return json.loads((found / MARKER).read_text())


@contextmanager
def atomic_directory(path: str | Path, meta: dict | None = None):
    """`with atomic_directory(path) as tmp:` write the checkpoint into `tmp`; on a clean exit it becomes `path`.

    Every rank enters the block (collective) and writes into the same `tmp` (a shared file system
    across nodes). Order on exit: all ranks done (barrier) -> rank 0 writes the marker -> rank 0
    renames `path` to `<path>.prev`, `tmp` to `path`, and deletes `.prev`. If the block raises, nothing
    is swapped: `path` still holds the last good checkpoint.
    """
    path = Path(path)
    tmp, prev = _sibling(path, ".tmp"), _sibling(path, ".prev")
    try:  # from the first directory made to the swap: an interrupt (Ctrl-C) anywhere leaves no `.tmp` behind
        with _interrupt_wins():
            if _rank() == 0:
                if tmp.exists():  # what an earlier, killed save left behind: never complete, never loaded
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            _barrier()
            yield tmp
            _barrier()
            if _rank() == 0:
                (tmp / MARKER).write_text(json.dumps(meta or {}, indent=1, default=float))
                _swap(tmp, path, prev)
            _barrier()
    except BaseException:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            shutil.rmtree(tmp, ignore_errors=True)  # (with several ranks the next save cleans it)
        raise


def _swap(tmp: Path, path: Path, prev: Path) -> None:
    """Replace `path` by `tmp` so that a complete checkpoint exists at every instant (see `resolve`)."""
    if is_complete(path):
        if prev.exists():
            shutil.rmtree(prev)  # older than `path`, which is complete
        path.rename(prev)
    elif path.exists():
        shutil.rmtree(path)  # incomplete: not a checkpoint (the last good one, if any, is at .prev)
    tmp.rename(path)  # a rename within one directory is atomic
    if prev.exists():
        shutil.rmtree(prev)


@contextmanager
def _interrupt_wins():
    """A Ctrl-C that lands inside a write can surface as the writer's own error (torch.save's zip writer, finishing
    a file the interrupt cut short, raises "unexpected pos"): whatever the block raises after a SIGINT arrived is
    a KeyboardInterrupt, so the run says where it stopped instead of a traceback. (Main thread only: Python
    handles signals there. A process started with SIGINT ignored, as `nohup` and `&` in a script start it, keeps
    ignoring it here too.)"""
    import signal
    import threading

    before = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or before == signal.SIG_IGN:
        yield
        return
    arrived = []

    def record(signum, frame):
        arrived.append(signum)
        if callable(before):
            before(signum, frame)
        else:  # SIG_DFL installed from outside Python: stop, as that would, but through the cleanup
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, record)
    try:
        yield
    except BaseException as e:
        if arrived and not isinstance(e, KeyboardInterrupt):
            raise KeyboardInterrupt from e
        raise
    finally:
        signal.signal(signal.SIGINT, before)


@contextmanager
def _quiet_single_process():
    """DCP warns that it "assumes" one process when no process group exists: here that is intended. And it logs
    the traceback of a metadata file that will not read (on the root logger) before it raises its own error: the
    caller gets that error, once."""
    def not_from_dcp(record) -> bool:
        return "distributed/checkpoint" not in record.pathname.replace("\\", "/")

    root = logging.getLogger()
    root.addFilter(not_from_dcp)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally:
        root.removeFilter(not_from_dcp)


@contextmanager
def _own_error():
    """DCP wraps each rank's exception in a `CheckpointException` (a BaseException whose text holds every rank's
    traceback): raise this rank's own instead, so that a Ctrl-C stays a KeyboardInterrupt and a full disk an OSError."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        own = e.failures.get(_rank()) or next(iter(e.failures.values()), None)
        if own is None:
            raise
        raise own[0] from None


def _state_dicts(model, optimizer):
    """What a checkpoint holds: the model's trainable weights (+ the optimizer's state). A frozen weight (LoRA's base,
    99% of the model) never changes: it comes from where the model was loaded, as the run's fingerprint of that model
    checks on resume; it is left out under each of its names (a tied head is the frozen embedding again)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    if optimizer is None:
        model_sd, out = get_model_state_dict(model), {}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        out = {"optim": optim_sd}
    return {"model": {k: v for k, v in model_sd.items() if k not in frozen}, **out}


def save_sharded(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 meta: dict | None = None) -> Path:
    """Save the model's trainable weights (+ optimizer) with DCP, every rank its own shards, atomically. Collective."""
    import torch.distributed.checkpoint as dcp

    state = _state_dicts(model, optimizer)
    with atomic_directory(path, meta) as tmp, _quiet_single_process(), _own_error():
        dcp.save(state, checkpoint_id=tmp)
    return Path(path)


def load_sharded(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a `save_sharded` checkpoint into `model` (+ `optimizer`), in place; return its metadata. Its frozen
    weights stay as `model` holds them.

    The model may be sharded differently than when it was saved (other ranks, or none): DCP reads
    the pieces each rank needs. Pass `optimizer=None` to load the weights only. Collective.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    found = resolve(path)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint at {path} (nor {_sibling(Path(path), '.prev')})")
    state = _state_dicts(model, optimizer)
    with _quiet_single_process(), _own_error():
        dcp.load(state, checkpoint_id=found)
    options = StateDictOptions(strict=False)  # the frozen weights stay as loaded (DCP refuses a missing trainable one)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
    return json.loads((found / MARKER).read_text())


def full_state_dict(model: torch.nn.Module, cpu_offload: bool = True) -> dict:
    """The unsharded weights as plain tensors. Collective: every rank takes part in the all-gathers.

    With `cpu_offload=True` only rank 0 receives them (on the CPU; the other ranks get `{}`), so a
    model larger than one GPU can still be exported; with False every rank gets the full dict on its device.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    return get_model_state_dict(model, options=options)


def plain_class(model: torch.nn.Module) -> type:
    """The model's own class: `fully_shard` swaps a module's class for an `FSDP<Name>` subclass."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if issubclass(c, torch.nn.Module) and not issubclass(c, FSDPModule))


def save_full(path: str | Path, model: torch.nn.Module, meta: dict | None = None,
              dtype: torch.dtype | None = None, source: str | Path | None = None, tokenizer=None) -> Path:
    """Export the unsharded weights, atomically: a Hugging Face directory (`from_pretrained` loads it)
    for a `PreTrainedModel`, else `model.pt` (a state dict for `torch.load`). `dtype` casts the floating
    weights (bf16: as Qwen2.5 ships; its config says so, so `from_pretrained` loads them as they are).
    `source`: the checkpoint directory the model was loaded from, whose layout the export keeps (`save_pretrained`);
    `tokenizer`: saved beside the weights, inside the same atomic write (a complete export always has it).
    Collective: a sharded model's tensors are gathered one at a time, cast, and kept in rank 0's CPU memory
    (a tied head is the embedding under a second name: neither gathered nor kept twice)."""
    hf = hasattr(model, "save_pretrained")
    skip = aliases(model) if hf else set()
    state = {}
    for name, t in model.state_dict().items():
        if name in skip:
            continue
        full = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2: an all-gather of this tensor only
        if _rank() == 0:
            state[name] = full.detach().to("cpu", dtype if dtype is not None and full.is_floating_point() else full.dtype,
                                           copy=True)
        del full
    with atomic_directory(path, meta) as tmp:
        if _rank() == 0:
            if hf:
                save_pretrained(model, tmp, state, dtype, source)
            else:
                torch.save(state, tmp / "model.pt")
            if tokenizer is not None:
                save_tokenizer(tokenizer, tmp)
    return Path(path)


def aliases(model: torch.nn.Module) -> set[str]:
    """The state-dict names under which a tensor listed before appears again: a tied output head is the input
    embedding's weight under a second name (Qwen2.5 up to 3B). A Hugging Face checkpoint stores such a tensor once,
    under its first name, and `from_pretrained` ties the other to it again. Read off the module's own tensors (the
    same object under two names), which FSDP2 and ZeRO-3 keep shared."""
    seen, again = set(), set()
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if id(tensor) in seen:
            again.add(name)
        seen.add(id(tensor))
    return again


def save_pretrained(model, directory: Path, state: dict, dtype: torch.dtype | None = None,
                    source: str | Path | None = None) -> None:
    """`model.save_pretrained` with `state`, and a config naming the plain class and the saved dtype.

    With `source` (the checkpoint directory the model was loaded from) the export is laid out as that checkpoint:
    the same tensor names (a tied head stored once, under the embedding's name), the source's `use_cache` (training
    turns the KV cache off in the live model's config: `model_dir.load_weights`) and the source's
    generation_config.json as it is (its sampling settings; a model built from its config alone, as FSDP2 and
    ZeRO-3 build theirs, knows only the defaults). A source without one gets none: `from_pretrained` derives the
    same defaults from config.json, as it does for the source."""
    tied = aliases(model)
    model.save_pretrained(directory, state_dict={k: v for k, v in state.items() if k not in tied})
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.architectures = [plain_class(model).__name__]  # not "FSDPQwen2ForCausalLM"
    if dtype is not None:
        config.dtype = dtype
    if source is not None:
        source = Path(source)
        config.use_cache = config.__class__.from_pretrained(source, local_files_only=True).use_cache
        written, kept = Path(directory) / "generation_config.json", source / "generation_config.json"
        if kept.is_file():
            shutil.copyfile(kept, written)
        else:
            written.unlink(missing_ok=True)
    config.save_pretrained(directory)


def save_tokenizer(tokenizer, directory: Path) -> None:
    """The tokenizer beside an exported model, both made to stop where the fine-tune taught it to: at the chat
    template's end-of-turn token (`<|im_end|>`), which every trained assistant turn ends with. A Qwen2.5 *base*
    checkpoint's eos is `<|endoftext|>`: exported as it came, plain `generate` after `apply_chat_template` would run
    on past each answer to `max_new_tokens`. So, as LLaMA-Factory's Qwen template does, the tokenizer's eos becomes
    the end of turn and generation_config.json's `eos_token_id` lists it beside the eos it had (a Qwen2.5-Instruct
    source, whose eos is the end of turn already, is written as it was). A pad token the tokenizer lacked and the
    recipe borrowed from eos (`model_dir.load_tokenizer`) is not saved: a later trainer that masks pad ids out of
    its labels would stop training the end of turn."""
    from transformers import AutoConfig, GenerationConfig

    from .data import end_of_turn

    directory = Path(directory)
    tokenizer.save_pretrained(directory)
    written = directory / "tokenizer_config.json"
    settings = json.loads(written.read_text())
    end = end_of_turn(tokenizer)
    if end is not None and _token_text(settings.get("eos_token")) != end:
        settings["eos_token"] = end
    if getattr(tokenizer, "pad_from_eos", False):
        settings["pad_token"] = None
    written.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")
    if end is None or not (directory / "config.json").is_file():  # (LoRA's --no-merge: the adapter, no model)
        return
    end_id = tokenizer.convert_tokens_to_ids(end)
    generation = GenerationConfig.from_pretrained(directory) if (directory / "generation_config.json").is_file() \
        else GenerationConfig.from_model_config(AutoConfig.from_pretrained(directory))
    eos = generation.eos_token_id
    eos = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    if end_id not in eos:
        generation.eos_token_id = eos + [end_id]
        generation.save_pretrained(directory)


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def is_peft(module) -> bool:
    return hasattr(module, "peft_config")


def export_lora(module, cfg, path: Path, tokenizer, is_main: bool, meta: dict) -> None:
    """LoRA's export: the adapter in peft's own format (`path/adapter`: what `PeftModel.from_pretrained` loads
    onto the base) and, unless `--no-merge`, beside it the merged model (`path`: what `from_pretrained` loads alone),
    in `--export-dtype`, laid out as the base (`save_pretrained` with `source`). The merge is made from the trained
    model itself, one adapted layer at a time (`merged_state`): no second copy of the model is loaded, except under
    QLoRA, whose 4-bit base is not the one to merge into: there the base is read again, in bf16. `meta`: the
    export's record (the backend's `export_meta`). Rank 0 writes."""
    from peft import PeftModel

    from .model_dir import load_weights

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.export_dtype]
    meta = {**meta, "lora": True, "merged": cfg.merge}
    with atomic_directory(path, meta) as tmp:
        if is_main:
            module.save_pretrained(tmp / "adapter")
            if cfg.merge:
                trained = PeftModel.from_pretrained(load_weights(cfg.model_path, torch.bfloat16), tmp / "adapter") \
                    if cfg.qlora else module
                state = merged_state(trained, dtype)
                save_pretrained(trained.get_base_model(), tmp, state, dtype, source=cfg.model_path)
            save_tokenizer(tokenizer, tmp)


def merged_state(module, dtype: torch.dtype) -> dict:
    """The tensors of a peft model's merged model, under the base model's names, in `dtype`, on the CPU: each adapted
    weight W + (alpha / r)·B·A (peft's `get_delta_weight`), summed in fp32 and rounded once, as peft's
    `merge_and_unload` rounds it; every other tensor as it is (no copy where it already has `dtype`). The model itself
    is left as it was; a tied head is the embedding, stored once."""
    from peft.tuners.lora import LoraLayer

    base = module.get_base_model()
    adapted = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    merged = {f"{name}.base_layer.weight" for name in adapted}
    adapter = tuple(f".{part}." for part in LoraLayer.adapter_layer_names)
    skip = aliases(base)
    state = {}
    for name, t in base.state_dict().items():
        if name in skip or name in merged or any(part in name for part in adapter):
            continue
        state[name.replace(".base_layer.", ".")] = t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype)
    with torch.no_grad():
        for name, m in adapted.items():
            weight = m.get_base_layer().weight.float()  # (an fp32 weight is itself: added to out of place, below)
            for a in m.active_adapters:
                weight = weight + m.get_delta_weight(a).float()
            state[f"{name}.weight"] = weight.to("cpu", dtype)
    return state
