"""course_lib.parallel.comm (chapters 05-08): the ring's per-rank volumes, the α + β fit, the counter at the process group
(in one process: a one-rank gloo group), Korthikanti's activation accounting for a Qwen2 layer; then one short
2-rank launch whose counts must equal FSDP2's formulas exactly."""
import copy

import pytest
import torch
import torch.distributed as dist

import course_lib as cl
from course_lib.parallel import comm
from course_lib.parallel import tensor_parallel as tpl

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=64)


@pytest.fixture
def group_of_one():
    """A one-rank gloo process group in this process (removed afterwards; tests/conftest.py sees that no test leaves
    one behind)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ring_factors():
    assert comm.ring_factor("all_reduce", 2) == 1.0 and comm.ring_factor("all_reduce", 8) == 2 * 7 / 8
    assert comm.ring_factor("all_gather", 4) == comm.ring_factor("reduce_scatter", 4) == 0.75
    assert comm.ring_factor("send", 2) == 1.0 and comm.ring_factor("recv", 2) == 0.0
    assert comm.ring_factor("all_reduce", 1) == 0.0  # alone, nothing is sent


def test_alpha_beta_fit_recovers_a_line_and_predicts():
    alpha, beta = 50e-6, 1e-9
    points = [[s, alpha + beta * s] for s in (1e3, 1e4, 1e5, 1e6, 1e7)]
    fit = comm.fit_alpha_beta(points)
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-6) and fit["beta"] == pytest.approx(beta, rel=1e-6)
    assert fit["max_rel_err"] < 1e-9
    noisy = [[s, t * (1.1 if i % 2 else 0.9)] for i, (s, t) in enumerate(points)]
    assert comm.fit_alpha_beta(noisy)["max_rel_err"] == pytest.approx(0.1, abs=0.05)
    calls = [{"kind": "all_reduce", "payload": 1e6}, {"kind": "send", "payload": 1e6}]
    assert comm.predict_seconds(calls, {"all_reduce": fit}) == pytest.approx(alpha + beta * 1e6)


def test_counter_sees_collectives_from_python_and_from_ddps_cpp_reducer(group_of_one):
    with comm.CommCounter(timed=True) as c:
        dist.all_reduce(torch.ones(100))
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(torch.empty(10), torch.ones(10))
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(torch.empty(10), torch.ones(10))
        dist.broadcast(torch.ones(7, dtype=torch.bfloat16), src=0)
    s = c.summary()
    assert s["all_reduce"]["payload"] == 400 and s["all_gather"]["payload"] == 40
    assert s["reduce_scatter"]["payload"] == 40 and s["broadcast"]["payload"] == 14
    assert c.total() == 0.0  # one rank sends nothing
    assert all(call.end is not None and call.end >= call.start for call in c.calls)
    model = cl.models.tiny_qwen2(**SMALL, seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    batch = cl.models.random_batch(SMALL["vocab_size"], 2, 8)
    with comm.CommCounter() as c:
        ddp(**batch).loss.backward()
    psi = sum(p.numel() for p in model.parameters())
    assert c.total("all_reduce", wire=False) == 4 * psi  # DDP's reducer (C++) all-reduced every fp32 gradient


def test_tags_and_records(group_of_one):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    class Reduce(torch.nn.Module):
        def forward(self, x):
            dist.all_reduce(x.detach().clone())
            return x

    layers = {"a": torch.nn.Sequential(model[0], Reduce()), "b": torch.nn.Sequential(model[1], Reduce())}
    with comm.CommCounter() as c:
        handles = comm.tag_modules(c, layers)
        layers["b"](layers["a"](torch.ones(2, 4)))
    for h in handles:
        h.remove()
    assert [call.tag for call in c.calls] == ["a fwd", "b fwd"]
    t = comm.traffic(c)
    assert t["calls"] == 2 and set(t["by_tag"]) == {"a fwd", "b fwd"}
    assert c.records(t0=c.calls[0].start)[0]["start"] == 0.0


def test_layer_activation_accounting_matches_what_autograd_saves():
    """Korthikanti-style count for one Qwen2 layer (fp32, SDPA, GQA), against the saved-tensor hooks."""
    model = cl.models.tiny_qwen2(**SMALL, seed=0)
    b, s = 3, 16
    x = torch.randn(b, s, SMALL["hidden_size"], requires_grad=True)
    pe = model.model.rotary_emb(x, torch.arange(s).unsqueeze(0))
    layer = copy.deepcopy(model.model.layers[0])
    with cl.SavedTensors(layer) as saved:
        layer(x, attention_mask=None, position_embeddings=pe)
    assert saved.bytes == tpl.layer_activation_bytes(b, s, model.config)["total"]
    split = tpl.layer_activation_bytes(b, s, model.config, t=2)
    both = tpl.layer_activation_bytes(b, s, model.config, t=2, sp="pytorch")
    megatron = tpl.layer_activation_bytes(b, s, model.config, t=2, sp="megatron")
    assert megatron["total"] < both["total"] < split["total"] < saved.bytes


def test_fsdp2_counts_equal_the_formulas_on_two_ranks():
    """One short launch: FSDP2's all-gathers and reduce-scatters, counted at the process group, are exactly
    root + 2L·layer and the whole model (default), the whole model twice (reshard_after_forward=False)."""
    from course_lib.recipes import fsdp

    cfg = fsdp.Config.from_preset(cl.preset("cpu", chapter="07"), parts="timeline", seq_len=16, micro_batch=2,
                                  prefetch_repeat=1, **SMALL)
    r = cl.launch(cfg, nproc=2, quiet=True, timeout=300).result["timeline"]
    full, layer, L = r["full_bytes"], r["layer_bytes"], SMALL["num_hidden_layers"]
    default, keep = r["default"]["comm"]["summary"], r["keep"]["comm"]["summary"]
    assert default["all_gather"]["payload"] == full + L * layer and default["all_gather"]["calls"] == 1 + 2 * L
    assert default["reduce_scatter"]["payload"] == full == keep["all_gather"]["payload"] == keep["reduce_scatter"]["payload"]
    assert r["bf16"]["comm"]["summary"]["all_gather"]["payload"] == (full + L * layer) // 2
    assert r["default"]["comm"]["bytes"] == (full + L * layer + full) / 2  # (N - 1)/N of both, N = 2
    assert [len(s) for s in r["prefetch"]["forward_s_ranks"]] == [1, 1]  # every rank's timed forwards


def _naive_ddp_rank(rank: int, world: int, store_path: str, out: str):
    from course_lib.parallel.data_parallel import DataParallelNaive

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    torch.manual_seed(rank)  # each rank starts from its own weights: the wrapper must make them rank 0's
    model = DataParallelNaive(torch.nn.Linear(4, 3))
    started = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(7)
    for _ in range(5):
        x = torch.randn(2 * world, 4, generator=data)
        y = torch.randn(2 * world, 3, generator=data)
        part = slice(2 * rank, 2 * rank + 2)
        torch.nn.functional.mse_loss(model(x[part]), y[part]).backward()
        opt.step()
        opt.zero_grad()
    torch.save({"started": started, "ended": [p.detach() for p in model.parameters()]}, f"{out}.{rank}")
    dist.destroy_process_group()
    cl.dist.exit_now()  # as the recipes end: no interpreter teardown, where a gloo rank has aborted once in a while


def test_naive_ddp_starts_every_rank_from_rank_0_and_equals_one_process(tmp_path):
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_naive_ddp_rank, args=(world, str(tmp_path / "store"), str(tmp_path / "w")), nprocs=world)
    ranks = [torch.load(tmp_path / f"w.{r}") for r in range(world)]
    torch.manual_seed(0)
    one = torch.nn.Linear(4, 3)  # rank 0's starting weights, trained in one process on the whole batch
    assert all(torch.equal(a, b) for r in ranks for a, b in zip(r["started"], one.parameters()))
    opt = torch.optim.SGD(one.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(7)
    for _ in range(5):
        x, y = torch.randn(2 * world, 4, generator=data), torch.randn(2 * world, 3, generator=data)
        torch.nn.functional.mse_loss(one(x), y).backward()
        opt.step()
        opt.zero_grad()
    for r in ranks:
        for got, want in zip(r["ended"], one.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)
