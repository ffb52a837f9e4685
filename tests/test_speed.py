"""The SFT recipe's speed paths (course_lib/sft/speed.py) keep the plain path's loss and gradients, each within a stated
tolerance (fp32, a tiny Qwen2): padding-free rows 1e-6, the chunked loss in forward 1e-6, compiled decoder layers 1e-5
(inductor reorders float sums), AdamW's fused/foreach/for-loop kernels 1e-6 after three steps, prefetched batches
identical; and the recipe with them trains like the recipe without them, in one process and under DDP, FSDP2 and
DeepSpeed ZeRO-3 (where the chunked loss must run inside the wrapped module's forward)."""
import copy
import json
import math

import pytest
import torch

import course_lib as cl
from course_lib.sft import data as D
from course_lib.sft import model_dir as M
from course_lib.sft import speed
from course_lib.config import ConfigError
from course_lib.recipes import sft

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=300)


@pytest.fixture
def model():
    return cl.models.tiny_qwen2(seed=0, **SHAPE)


def example_rows(lengths=(7, 19, 12, 30), seed=1) -> list[dict]:
    """Rows of these lengths, the first third of each a prompt (label -100), as tokenize_chats makes them."""
    g, rows = torch.Generator().manual_seed(seed), []
    for n in lengths:
        ids = torch.randint(0, SHAPE["vocab_size"], (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [t if i > n // 3 else D.IGNORE for i, t in enumerate(ids)]})
    return rows


def loss_and_grads(model, batch, loss_chunk=0):
    model.zero_grad(set_to_none=True)
    loss = sft.sft_loss(model, batch, loss_chunk)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a, b, atol):
    assert a[0] == pytest.approx(b[0], abs=atol)
    worst = max((a[1][k] - b[1][k]).abs().max().item() for k in a[1])
    assert worst <= atol, f"gradients differ by {worst:.3g} > {atol}"


def test_flatten_joins_examples_with_restarting_positions_and_the_same_targets():
    rows = example_rows()
    flat, padded = D.collate(rows, 0, padding_free=True), D.collate(rows, 0)
    assert flat["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows)) and "attention_mask" not in flat
    starts = [0, 7, 26, 38]
    assert flat["position_ids"][0, starts].tolist() == [0, 0, 0, 0] and flat["position_ids"][0, -1] == 29
    assert all(flat["labels"][0, s] == D.IGNORE for s in starts)  # no example learns the next one's first token
    assert cl.train.count_targets(flat) == cl.train.count_targets(padded)


def test_padding_free_rows_give_the_padded_loss_and_gradients(model):
    rows = example_rows()
    assert_same(loss_and_grads(model, D.collate(rows, 0, padding_free=True)), loss_and_grads(model, D.collate(rows, 0)),
                atol=1e-6)


def test_the_chunked_loss_in_forward_gives_the_plain_loss_and_gradients(model, tmp_path):
    rows = example_rows()
    batch = D.collate(rows, 0)
    plain = loss_and_grads(model, batch)
    keys = list(model.state_dict())
    speed.loss_in_forward(model)
    assert type(model).__name__ == "Qwen2ForCausalLM" and list(model.state_dict()) == keys
    for chunk in (1024, 16):  # one chunk, several
        assert_same(loss_and_grads(model, batch, loss_chunk=chunk), plain, atol=1e-6)
        assert_same(loss_and_grads(model, D.collate(rows, 0, padding_free=True), loss_chunk=chunk), plain, atol=1e-6)
    # without loss_chunk it is the model's own forward: logits, its loss, generation, save_pretrained
    assert model(**batch).loss.item() == pytest.approx(plain[0], rel=1e-5)  # HF's loss: mean over the same targets
    assert model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape == (1, 5)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


@pytest.mark.slow
def test_compiled_decoder_layers_give_the_same_loss_and_gradients(model):
    compiled = speed.compile_layers(copy.deepcopy(model))
    for lengths in ((7, 19, 12, 30), (5, 40, 9)):  # two lengths, one graph (dynamic shapes)
        batch = D.collate(example_rows(lengths), 0, padding_free=True)
        assert_same(loss_and_grads(compiled, batch), loss_and_grads(model, batch), atol=1e-5)
    assert list(compiled.state_dict()) == list(model.state_dict())  # Module.compile in place: same names


@pytest.mark.parametrize("impl", ["foreach", "forloop"])
def test_adamw_kernels_take_the_same_steps(model, impl):
    cfg = sft.Config(model_path="m", data_dir="d", out_dir="o", optim_impl=impl)
    other = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, **speed.adamw_kernel(c, "fused"))
            for m, c in ((model, sft.Config(model_path="m", data_dir="d", out_dir="o")), (other, cfg))]
    batch = D.collate(example_rows(), 0)
    for _ in range(3):
        for m, opt in zip((model, other), opts):
            sft.sft_loss(m, batch).backward()
            opt.step()
            opt.zero_grad()
    worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), other.parameters()))
    assert worst <= 1e-6, worst


def test_the_prefetcher_yields_what_make_makes_in_order():
    made = list(speed.Prefetcher(lambda step: {"step": step}, range(3, 8)))
    assert made == [{"step": s} for s in range(3, 8)]
    assert list(speed.Prefetcher(lambda s: s, range(0))) == []


def test_speed_flags_are_checked_in_one_line():
    for bad, match in ((dict(optim_impl="adam8"), "--optim-impl must be one of"), (dict(loss_chunk=-1), "--loss-chunk"),
                       (dict(compile=True, deepspeed="zero2"), "--compile is for")):
        with pytest.raises(ConfigError, match=match):
            sft.Config(model_path="m", data_dir="d", out_dir="o", **bad)
    cfg = sft.Config(model_path="m", data_dir="d", out_dir="o", padding_free=True, loss_chunk=256, compile=True,
                     prefetch=True, optim_impl="foreach", save=False)
    assert sft.Config.parse(cfg.to_argv()) == cfg


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("speed")
    D.write_task(root / "data", n_train=128, n_eval=8)
    train, _ = D.make_examples(n_train=128, n_eval=8)
    base = M.make_tiny_checkpoint(root / "base", D.chat_corpus(train), {k: v for k, v in SHAPE.items() if k != "vocab_size"},
                                  vocab_size=300)
    return root, base


def recipe_config(work, name, **kw):
    root, base = work
    settings = dict(steps=3, micro_batch=4, accum=2, lr=1e-3, eval_n=4, precision="fp32", progress=False, export=False,
                    save=False)
    return sft.Config(model_path=str(base), data_dir=str(root / "data"), out_dir=str(root / name), **{**settings, **kw})


FAST = dict(padding_free=True, loss_chunk=16, prefetch=True)


def test_the_recipe_with_its_speed_paths_trains_like_without(work):
    plain = sft.train(recipe_config(work, "plain"))
    fast = sft.train(recipe_config(work, "fast", **FAST, optim_impl="foreach"))
    assert fast["targets"] == plain["targets"]  # the same examples, the same target tokens, every step
    assert fast["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert fast["eval"][-1]["loss"] == pytest.approx(plain["eval"][-1]["loss"], rel=1e-5)
    assert sum(fast["batch_tokens"]) < sum(plain["batch_tokens"])  # and no padding was computed


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_recipe_under_ddp_fsdp2_and_zero3_with_its_speed_paths(work):
    """One code path under every launcher: one process on the whole global batch, without the speed paths, is the
    reference (here, in this process); DDP, FSDP2 (the model gathered once to generate,
    and a layer gathered in every forward) and ZeRO-3 with the speed paths take the same examples and losses, write a
    complete checkpoint and an export that loads as a plain HF model. The chunked loss reads the output embedding inside
    the wrapped module's forward: DDP reduces its gradient, FSDP2 holds the root's weights unsharded there, ZeRO-3
    fetches it as an external parameter of the root. FSDP2 in fp16 (a GPU without bf16) trains as fp32 does."""
    # the reference: the global batch (micro-batch 4 x accum 2 x 2 ranks) in one process, the same rows every step
    reference = sft.train(recipe_config(work, "one-process", accum=4, weight_decay=0.1))
    runs = {}
    for name, launcher, extra in (("ddp", "torchrun", FAST),
                                  ("fsdp", "torchrun", {**FAST, "fsdp": True, "optim_impl": "fused"}),
                                  ("fsdp-layerwise", "torchrun", {**FAST, "fsdp": True, "gather_generate": False}),
                                  ("zero3", "deepspeed", {**FAST, "deepspeed": "zero3"}),
                                  ("fsdp-fp16", "torchrun", {"fsdp": True, "precision": "fp16"})):
        # weight decay on: its two parameter groups (matrices; biases and norms) under every wrapper
        cfg = recipe_config(work, name, **extra, save=True, export=True, weight_decay=0.1)
        res = cl.launch(cfg, nproc=2, launcher=launcher, timeout=300, env={"OMP_NUM_THREADS": "1"}).result
        assert res["world_size"] == 2 and res["step"] == [1, 2, 3], name
        assert all(math.isfinite(x) for x in res["loss"] + res["grad_norm"]), name
        assert res["backend"] == {"zero3": "deepspeed"}.get(name, name.split("-")[0]), res["backend"]
        assert res["precision"] == extra.get("precision", "fp32"), name
        assert 0.0 <= res["exact_match_after"] <= 1.0
        out = work[0] / name
        assert cl.checkpoint.is_complete(out / "checkpoint-000003"), name
        if name.endswith("fp16"):  # the loss scale resumes with the run (no step of the tiny model overflows)
            assert cl.checkpoint.read_meta(out / "checkpoint-000003")["scaler"]["scale"] == 2.0 ** 16
        M.load_model(out / "final")  # the export loads as a plain HF model
        runs[name] = res
    for name in ("ddp", "fsdp", "fsdp-layerwise", "zero3"):
        assert runs[name]["targets"] == reference["targets"], name
        assert runs[name]["loss"] == pytest.approx(reference["loss"], rel=1e-4), name
        assert runs[name]["lr"] == pytest.approx(reference["lr"], rel=1e-6), name  # each step's lr, the one it applied
    # FSDP2 in fp16 (its weights gathered in fp16, the loss scaled, every rank's shards checked for overflow by
    # ShardedGradScaler) trains as fp32 does, within fp16's 11 significant bits over three steps
    assert runs["fsdp-fp16"]["targets"] == reference["targets"]
    assert runs["fsdp-fp16"]["loss"] == pytest.approx(reference["loss"], rel=2e-3)
    # generation with the model gathered once (the default) answers as a layer gathered in every forward does
    assert runs["fsdp"]["samples"] == runs["fsdp-layerwise"]["samples"] and runs["fsdp"]["samples"]
