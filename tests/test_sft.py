"""The SFT pieces of chapters 09-10: the loss mask on one example, the checkpoint-directory check, and
the recipe (course_lib/recipes/sft.py) under torchrun DDP, DeepSpeed ZeRO-2 and FSDP2 for a few steps."""
import math

import pytest
import torch

import course_lib as cl
from course_lib import data as D
from course_lib import model_dir as T
from course_lib.recipes import sft

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, tie_word_embeddings=True)


def corpus(rows):
    return [f"user\n{r['messages'][0]['content']}\nassistant\n{r['messages'][1]['content']}\n" for r in rows]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    D.write_task(root / "data", n_train=256, n_eval=8)
    train, _ = D.make_examples(n_train=256, n_eval=8)
    base = T.make_tiny_checkpoint(root / "base", corpus(train), TINY, vocab_size=300)
    return root, base


def test_loss_mask_covers_exactly_the_assistant_answer(task):
    _, base = task
    _, tok = T.load_model(base)
    example = {"messages": [{"role": "user", "content": "Reverse 5677693"}, {"role": "assistant", "content": "3967765"}]}
    ids, mask = D.assistant_mask(tok, example["messages"])
    assert (ids, mask) == D.prefix_mask(tok, example["messages"])  # the template's mask = the prefix rule
    trained = [t for t, m in zip(ids, mask) if m]
    assert tok.decode(trained) == "3967765<|im_end|>"
    assert tok.decode(ids[:mask.index(1)]).endswith("<|im_start|>assistant\n")
    assert all(c == 1 for c in mask[mask.index(1):len(mask) - 1]) and mask[-1] == 0  # the final "\n" is not trained
    row = D.tokenize_example(example, tok, max_len=64)
    assert [lab for lab in row["labels"] if lab != D.IGNORE] == trained
    assert [t for t in tok.convert_ids_to_tokens(ids) if len(t) == 1 and t.isdigit()][:7] == list("5677693")  # one token a digit


def test_bad_model_path_gives_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory") as err:
        T.check_model_dir(tmp_path / "nope")
    assert "config.json" in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="missing tokenizer.json, tokenizer_config.json, \\*.safetensors"):
        T.check_model_dir(tmp_path)


def test_packing_keeps_every_token_and_restarts_positions(task):
    _, base = task
    _, tok = T.load_model(base)
    train, _ = D.make_examples(n_train=20, n_eval=1)
    from datasets import Dataset

    rows = D.tokenize_dataset(Dataset.from_list(train), tok, 64)
    packed = D.pack(rows, 128)
    assert all(len(r["input_ids"]) == 128 for r in packed)
    kept = sum(sum(lab != D.IGNORE for lab in r["labels"]) for r in packed)
    assert kept == sum(sum(lab != D.IGNORE for lab in r["labels"]) for r in rows)
    assert packed[0]["position_ids"][0] == 0 and packed[0]["position_ids"].count(0) >= 2
    # restarting position_ids keeps attention inside each example: the second one's logits are its own
    model, _ = T.load_model(base)
    first, second = rows[0]["input_ids"], rows[1]["input_ids"]
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([second])).logits[0]
        joined = model(input_ids=torch.tensor([first + second]),
                       position_ids=torch.tensor([list(range(len(first))) + list(range(len(second)))])).logits[0]
    assert (joined[len(first):] - alone).abs().max() < 1e-5


def test_recipe_loss_equals_the_models_loss(task):
    _, base = task
    model, tok = T.load_model(base)
    train, _ = D.make_examples(n_train=8, n_eval=1)
    batch = D.collate([D.tokenize_example(r, tok, 64) for r in train], tok.pad_token_id)
    assert sft.sft_loss(model, batch).item() == pytest.approx(model(**batch).loss.item(), rel=1e-6)


@pytest.mark.timeout(400)
def test_recipe_under_ddp_deepspeed_and_fsdp(task):
    root, base = task
    common = sft.Config(model_path=str(base), data_dir=str(root / "data"), out_dir="", steps=3, micro_batch=4, accum=2,
                        eval_n=4, precision="fp32", progress=False, lr=1e-3)
    runs = {}
    for name, launcher, extra in (("ddp", "torchrun", {}), ("deepspeed", "deepspeed", {"deepspeed": "zero3"}),
                                  ("fsdp", "torchrun", {"fsdp": True}),
                                  ("fsdp_layerwise", "torchrun", {"fsdp": True, "gather_generate": False})):
        cfg = cl.config.replace(common, out_dir=str(root / name), **extra)
        run = cl.launch(cfg, nproc=2, launcher=launcher, timeout=240, env={"OMP_NUM_THREADS": "1"})
        res = run.result
        assert res["backend"] == name.split("_")[0] and res["world_size"] == 2 and res["step"] == [1, 2, 3]
        assert all(math.isfinite(x) for x in res["loss"] + res["grad_norm"])
        assert 0.0 <= res["exact_match_after"] <= 1.0
        assert cl.checkpoint.is_complete(root / name / "checkpoint-000003")
        model, _ = T.load_model(root / name / "final")  # the export loads as a plain HF model
        runs[name] = res
    # one code path: same model, data and order -> the same losses whatever the backend
    for name in ("deepspeed", "fsdp"):
        assert runs[name]["loss"] == pytest.approx(runs["ddp"]["loss"], rel=1e-4), name
    # generation with the model gathered once (the default) answers as a layer gathered in every forward does
    assert runs["fsdp"]["samples"] == runs["fsdp_layerwise"]["samples"] and runs["fsdp"]["samples"]
