"""FSDP2 helpers (chapter 07): shard a Qwen2 model the way the course teaches, and fill a model that was built
on the meta device from a checkpoint read once, on rank 0. The SFT recipe's FSDP2 backend (course_lib/sft/backends.py)
and chapter 07's recipe (course_lib/recipes/fsdp.py) both use them.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path



def shard_model(model, mesh, reshard_after_forward: bool | None = None, mp_policy=None, offload_policy=None):
    """FSDP2: each `Qwen2DecoderLayer` becomes one unit (gathered and freed together), then the root
    takes what is left (embeddings, final norm, the tied head). Parameters become sharded DTensors.
    `reshard_after_forward=None` is FSDP2's default: True for the layers (free after forward, gather
    again in backward), False for the root (its parameters are needed again first thing in backward)."""
    from torch.distributed.fsdp import fully_shard

    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def fill_from_rank0(model, path, device) -> None:
    """Load a checkpoint directory's weights into a sharded (FSDP2) model: rank 0 reads them (`path`; None on the
    other ranks) and broadcasts each tensor; every rank keeps its shard. Buffers that checkpoints do not store
    (rotary embeddings' frequencies) are computed anew."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = {}
    if path is not None:
        for file in sorted(Path(path).glob("*.safetensors")):
            state.update(load_file(file))  # as stored (bf16 for Qwen2.5): each shard is cast as it is copied in
        if getattr(model.config, "tie_word_embeddings", False):
            state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del state
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            fresh = type(module)(module.config).to(device)
            for name, buffer in fresh.named_buffers(recurse=False):
                module._buffers[name] = buffer
            for name in ("attention_scaling",):
                if hasattr(fresh, name):
                    setattr(module, name, getattr(fresh, name))


@contextmanager
def gathered(model, value=None):
    """The model's layers gathered once and kept for what runs inside (generation: one all-gather per layer, not one
    per layer per token: the 0.5B test's evaluation on 2 CPU ranks took 14 s, 73 s before), then sharded again.
    FSDP2's own eval switch, `set_reshard_after_forward(False)`; each rank needs the whole model's room meanwhile
    (at 0.5B its peak RSS stayed the training step's, 6.5 GB on 2 CPU ranks). Yields `value`."""
    layers = list(model.model.layers)
    for layer in layers:
        layer.set_reshard_after_forward(False)
    yield value
    for m in [*layers, model]:
        m.reshard()
        m.set_reshard_after_forward(m is not model, recurse=False)  # shard_model's defaults: layers True, root False
