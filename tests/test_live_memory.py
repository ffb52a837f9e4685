"""cl.LiveTensorBytes: exact byte counts, the baseline, categories, resizes, DTensor shards (FSDP2 on one
rank, in-process), and one 2-rank launch per distributed backend (DDP, FSDP2, ZeRO-2, ZeRO-3)."""
import contextlib
import gc

import pytest
import torch
import torch.nn.functional as F

import course_lib as cl
from course_lib.memory.live_memory import CATEGORIES, LiveTensorBytes, state_tensors

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
             vocab_size=128)


def test_counts_new_storages_views_and_frees_exactly():
    outside = torch.empty(1000)
    with LiveTensorBytes() as mem:
        a = torch.empty(250)                  # 1000 B
        view = a.view(5, 50)                  # same storage: nothing new
        b = torch.ones(10).add_(1)            # 40 B, the in-place add makes nothing
        assert mem.now == 1040
        del a
        assert mem.now == 1040                # the view keeps the storage alive
        del view
        gc.collect()
        assert mem.now == 40
        outside.add_(1)                       # made before the block: from now on it counts, from the start
        assert mem.now == 4040 and mem.now_by_category()["inputs"] == 4000
    assert mem.peak == 5040
    assert mem.timeline()["total"] == [4000, 5000, 5040, 4040]
    del b


def test_a_storage_made_out_of_sight_counts_from_when_seen_unless_it_outlives_the_block():
    """A tensor made where the mode cannot see (here: modes disabled; under ZeRO-3 on gloo, 121 reduce-scatter
    buffers of 1.95 GB in all at 0.5B) and freed inside the block was not held before it: it counts from when an
    operation first returns it. One that outlives the block was made before it: it counts from the start."""
    from torch.utils._python_dispatch import _disable_current_modes

    with LiveTensorBytes() as mem:
        a = torch.empty(250)                  # 1000 B
        with _disable_current_modes():
            hidden, kept = torch.zeros(500), torch.zeros(100)  # 2000 B, 400 B: no operation seen
        del a
        hidden.add_(1)                        # seen now, freed at once
        del hidden
        kept.add_(1)                          # seen now, alive after the block
    assert mem.timeline()["total"] == [400, 1400, 400, 2400, 400]
    assert mem.peak == 2400 and mem.peak_by_category()["inputs"] == 2400
    del kept


def test_resizes_are_followed_both_ways():
    made_before = torch.empty(100)           # 400 B, unseen until it grows
    with LiveTensorBytes() as mem:
        t = torch.empty(10)                   # 40 B
        t.resize_(1000)                       # aten.resize_: grows to 4000 B
        assert mem.now == 4000
        t.untyped_storage().resize_(0)        # UntypedStorage.resize_ (FSDP2 frees this way): not an op
        assert mem.now == 0
        made_before.untyped_storage().resize_(800)  # counted from here, its old 400 B as baseline
        assert mem.now == 800 and mem.timeline()["total"][0] == 400
    assert "resize_" not in vars(torch.UntypedStorage)  # the patch is gone


def test_nested_trackers_both_count_and_restore():
    with LiveTensorBytes() as outer:
        with LiveTensorBytes() as inner:
            x = torch.empty(64)
            x.untyped_storage().resize_(512)
        assert inner.now == outer.now == 512
    assert "resize_" not in vars(torch.UntypedStorage)
    del x


def _step(model, opt, batch, chunked=False):
    logits = model(input_ids=batch["input_ids"]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    del logits
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_watching_makes_autograd_sum_a_tied_weights_gradients_out_of_place():
    """The observer effect the module's docstring states: a weight used twice (a tied embedding under DeepSpeed's
    linear, whose weight gradient is contiguous) gets its two gradients summed in place into the first one when
    nothing watches, and into a new tensor, one gradient-sized copy more, while cl.LiveTensorBytes does."""
    made: list = []  # the data pointer of each weight gradient the head returns

    class ContiguousLinear(torch.autograd.Function):  # what DeepSpeed's memory_efficient_linear returns
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            grad_w = grad.t() @ x
            made.append(grad_w.data_ptr())
            return grad @ w, grad_w

    def head_grad_is_the_sum(watch: bool) -> bool:
        made.clear()
        w = torch.nn.Parameter(torch.randn(64, 8))
        with LiveTensorBytes() if watch else contextlib.nullcontext():
            ContiguousLinear.apply(F.embedding(torch.tensor([1, 2, 3]), w), w).sum().backward()
        return w.grad.data_ptr() == made[0]

    assert head_grad_is_the_sum(watch=False) and not head_grad_is_the_sum(watch=True)


def test_training_step_baseline_categories_and_end_state():
    model = cl.models.tiny_qwen2(**SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = cl.models.random_batch(SMALL["vocab_size"], 2, 16)
    _step(model, opt, batch)                  # AdamW's state exists from here
    state = cl.model_state_bytes(model, opt)
    mem = LiveTensorBytes(model, opt)
    with mem:
        mem.mark("forward")
        logits = model(input_ids=batch["input_ids"]).logits
        mem.mark("loss")
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        del logits
        mem.mark("backward")
        loss.backward()
        grads_now = mem.now_by_category()["gradients"]
        mem.mark("step")
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
    tl = mem.timeline()
    inputs = tl["inputs"][0]                                     # the batch: seen through a view
    # and, where transformers reads the rotary's inv_freq buffer through an operation (5.17), that buffer too
    batch_bytes, inv_freq = batch["input_ids"].untyped_storage().nbytes(), model.model.rotary_emb.inv_freq.nbytes
    assert inputs in (batch_bytes, batch_bytes + inv_freq)
    assert tl["total"][0] - inputs == state["total"]             # the rest of the baseline: the model state
    assert grads_now == state["params"]                          # every parameter got its gradient
    assert mem.now - inputs == state["total"] == sum(mem.now_by_category().values()) - inputs  # nothing leaked
    at_peak = mem.peak_by_category()
    assert sum(at_peak.values()) == mem.peak == max(tl["total"])
    assert at_peak["parameters"] == state["params"] and at_peak["optimizer"] == state["optimizer"]
    assert at_peak["activations"] > 0 and at_peak["logits"] > 0
    assert set(mem.phase_peaks()) == {"forward", "loss", "backward", "step"}
    assert max(mem.phase_peaks().values()) == mem.peak
    assert list(tl["marks"][i][1] for i in range(4)) == ["forward", "loss", "backward", "step"]
    assert mem.categories()[:len(CATEGORIES)] == list(CATEGORIES)


def test_activations_are_what_autograd_saved():
    """At the start of backward, the activations are the saved tensors (minus those of the loss phase)."""
    model = cl.models.tiny_qwen2(**SMALL)
    batch = cl.models.random_batch(SMALL["vocab_size"], 2, 16)
    mem = LiveTensorBytes(model, logits_module=None)   # no logits category: the whole forward is activations
    with mem:
        with cl.SavedTensors(model) as saved:
            logits = model(input_ids=batch["input_ids"]).logits
            out = logits.sum()
        mem.mark("backward")
        out.backward()
    at = next(i for _, i, label in mem.marks if label == "backward")
    held = mem.timeline()["activations"][at]
    # held = saved + the logits (alive, not saved) + the scalar output, less the token ids that the
    # embedding saved: made before the block, they are "inputs"
    ids_bytes = batch["input_ids"].untyped_storage().nbytes()
    assert held == saved.bytes - ids_bytes + logits.untyped_storage().nbytes() + 4


def test_tag_files_a_tensor_under_a_new_category():
    with LiveTensorBytes() as mem:
        x = torch.empty(100)
        mem.tag(x, "host")
    assert mem.now_by_category()["host"] == 400 and "host" in mem.categories()


def test_state_tensors_follow_wrappers_and_master_copies():
    model = torch.nn.Linear(4, 4)
    master = [torch.zeros(4, requires_grad=True)]   # a wrapper's fp32 copy, stepped by the inner optimizer

    class Wrapper:
        def __init__(self):
            self.optimizer = torch.optim.SGD(list(model.parameters()) + master, lr=0.1, momentum=0.9)

    wrapped = Wrapper()
    (model(torch.ones(1, 4)).sum() + master[0].sum()).backward()
    wrapped.optimizer.step()
    found = state_tensors(model, wrapped)
    assert len(found["parameters"]) == 2 and found["optimizer"][0] is master[0]
    assert len(found["gradients"]) == 3 and len(found["optimizer"]) == 1 + 3  # master + 3 momentum buffers


def test_fsdp2_on_one_rank_counts_local_shards_and_gathers():
    """FSDP2 in this process (a group of one): DTensor parameters, gathers freed with storage.resize_(0)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = cl.models.tiny_qwen2(**SMALL)
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = cl.models.random_batch(SMALL["vocab_size"], 2, 16)
        _step(model, opt, batch)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        shards = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
        states = cl.tensor_bytes(t.to_local() for s in opt.state.values() for t in s.values() if isinstance(t, DTensor))
        mem = LiveTensorBytes(model, opt)
        with mem:
            _step(model, opt, batch)
        assert mem.timeline()["total"][0] >= shards + states  # + AdamW's step counters
        assert mem.now == mem.timeline()["total"][0]        # the gathered parameters were freed again
        gathered = mem.peak_by_category()["parameters"] - shards  # what the step held beside the shards, at its peak
        layer = max(cl.tensor_bytes(p.to_local() for p in block.parameters()) for block in model.model.layers)
        assert layer <= gathered <= shards, (gathered, layer, shards)  # at least one layer gathered whole, counted
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "zero2", "zero3"])
def test_distributed_backends_on_two_ranks(backend):
    """Each rank: the categories at the peak add up to it, the baseline and the end of the step equal the
    model state walked independently (FSDP2: local shards; DeepSpeed: course_lib.parallel.zero.held_bytes), and a
    sharded backend's baseline holds half the parameters while its peak sees them gathered."""
    from pathlib import Path

    script = Path(__file__).with_name("ranks_live_memory.py")
    run = cl.launch(script, ["--backend", backend], nproc=2, launcher="torchrun", quiet=True, timeout=600)
    for rank in run.result["ranks"]:
        assert rank["at_peak_sum"] == rank["peak"] >= rank["baseline"] > 0
        assert rank["activations_at_peak"] > 0
        # ZeRO-3 also keeps its reduce bucket between steps (4096 fp32 elements here): live, not model state
        assert rank["bucket"] == (4096 * 4 if backend == "zero3" else 0)
        assert rank["baseline"] == rank["state_before"] + rank["bucket"]
        # DeepSpeed keeps a scalar or two from the step (the loss, the gradient norm): live, not state
        assert 0 <= rank["now_end"] - rank["bucket"] - rank["state_after"] <= (64 if backend.startswith("zero") else 0)
        if backend in ("fsdp2", "zero3"):
            assert 2 * rank["baseline_params"] == rank["full_param_bytes"]
            assert rank["at_peak"]["parameters"] > rank["baseline_params"]
