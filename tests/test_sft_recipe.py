"""What a practitioner expects of the SFT recipe (course_lib/recipes/sft.py), on the tiny model in this process:
bad input ends in one line with nothing written, truncation is counted, held-out loss and samples, bf16 export
that reloads with identical logits, LoRA adapters saved and merged, checkpoint rotation, QLoRA refused on CPU."""
import json
from pathlib import Path

import pytest
import torch

import course_lib as cl
from course_lib import data as D
from course_lib import model_dir as M
from course_lib.config import ConfigError
from course_lib.recipes import sft

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
SYSTEM = {"role": "system", "content": "You reverse digits."}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_recipe")
    train, held_out = D.make_examples(n_train=128, n_eval=6)
    # multi-turn conversations with a system prompt: every assistant turn is trained
    chats = [{"messages": [SYSTEM, *a["messages"], *b["messages"]]} for a, b in zip(train[::2], train[1::2])]
    D.write_jsonl(chats, root / "data" / "train.jsonl")
    D.write_jsonl([{"messages": [SYSTEM, *r["messages"]]} for r in held_out], root / "data" / "eval.jsonl")
    base = M.make_tiny_checkpoint(root / "base", D.chat_corpus(train), TINY, vocab_size=300)
    return root, base


def config(work, name, **kw):
    root, base = work
    defaults = dict(model_path=str(base), data_dir=str(root / "data"), out_dir=str(root / name), steps=3,
                    micro_batch=4, seq_len=96, lr=1e-3, eval_n=4, precision="fp32", progress=False)
    return sft.Config(**{**defaults, **kw})


def one_line_error(cfg, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        sft.main(cfg.to_argv())
    message = str(exit_.value.code)
    assert message.startswith("sft.py: error: ") and "\n" not in message, message
    assert not capsys.readouterr().out.strip()  # no traceback, no half-done report
    return message


def test_bad_input_ends_in_one_line_and_writes_nothing(work, tmp_path, capsys):
    root, base = work
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert "missing tokenizer.json" in one_line_error(config(work, "x", model_path=str(empty), out_dir=str(tmp_path / "o1")), capsys)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                                     '{"messages": [{"role": "user", "content": "hi"}\n')
    (bad / "eval.jsonl").write_text((root / "data" / "eval.jsonl").read_text())
    assert f"{bad / 'train.jsonl'}:2: not valid JSON" in one_line_error(config(work, "x", data_dir=str(bad), out_dir=str(tmp_path / "o2")), capsys)
    (bad / "train.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert ":1: the conversation has no assistant turn" in one_line_error(config(work, "x", data_dir=str(bad), out_dir=str(tmp_path / "o3")), capsys)
    (bad / "train.jsonl").write_text('{"messages": [{"role": "robot", "content": "hi"}]}\n')
    assert "unknown role 'robot'" in one_line_error(config(work, "x", data_dir=str(bad), out_dir=str(tmp_path / "o4")), capsys)
    assert "raise --seq-len" in one_line_error(config(work, "x", seq_len=8, out_dir=str(tmp_path / "o5")), capsys)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6)), "a failed start left files behind"


def test_truncation_is_counted_and_examples_without_targets_are_dropped(work):
    _, base = work
    tok = M.load_tokenizer(base)
    rows = [{"messages": [{"role": "user", "content": "Reverse " + "1" * n}, {"role": "assistant", "content": "21"}]}
            for n in (2, 30)]
    out, stats = D.tokenize_chats(rows, tok, max_len=20)
    assert stats["examples"] == 2 and stats["dropped"] == 1 and stats["truncated"] == 1 and len(out) == 1
    assert stats["target_tokens"] == 3  # "2", "1", <|im_end|>
    line = D.describe_truncation(stats, 20)
    assert line.startswith("warning: 1 of 2 examples dropped") and "--seq-len 20" in line


def test_a_run_evaluates_samples_exports_and_rotates(work):
    cfg = config(work, "run", steps=4, save_every=1, keep_last=2, eval_every=2)
    res = sft.train(cfg)
    out = Path(cfg.out_dir)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000003", "checkpoint-000004"]
    assert [e["step"] for e in res["eval"]] == [2, 4] and all(e["perplexity"] > 1 for e in res["eval"])
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and samples[0]["step"] == 4 and samples[0]["prompt"].startswith("Reverse")
    # the loss was taken on every assistant turn of the multi-turn chats: two answers per conversation
    tok = M.load_tokenizer(cfg.model_path)
    rows, stats = D.tokenize_chats(D.read_chats(Path(cfg.data_dir) / "train.jsonl"), tok, cfg.seq_len)
    assert stats["dropped"] == 0 and res["data"] == stats
    first = D.step_indices(0, len(rows), cfg.micro_batch, cfg.seed)
    assert res["targets"][0] == sum(sum(t != D.IGNORE for t in rows[i]["labels"][1:]) for i in first)
    # the export: bf16 safetensors that from_pretrained loads as they are, with the final weights
    exported = M.load_weights(out / "final", dtype="auto")
    assert next(exported.parameters()).dtype == torch.bfloat16
    final = M.load_weights(cfg.model_path)  # the last checkpoint's fp32 weights, cast as the export casts them
    cl.checkpoint.load_sharded(out / "checkpoint-000004", final)
    reference = M.load_weights(cfg.model_path, dtype=torch.bfloat16)
    reference.load_state_dict({k: v.to(torch.bfloat16) for k, v in final.state_dict().items()})
    for (name, a), b in zip(exported.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    batch = cl.models.random_batch(final.config.vocab_size, 2, 12)
    with torch.no_grad():
        want = reference(input_ids=batch["input_ids"]).logits
        got = exported(input_ids=batch["input_ids"]).logits
    assert torch.equal(got, want), "the exported model reloads with the trained weights' logits"


def test_lora_saves_an_adapter_and_a_merged_model(work):
    from peft import PeftModel

    cfg = config(work, "lora", lora=True, lora_r=4, export_dtype="fp32")
    res = sft.train(cfg)
    assert 0 < res["trainable"] < res["params"] / 10 and res["lr_peak"] == 1e-3
    final = Path(res["final_dir"])
    assert (final / "adapter" / "adapter_model.safetensors").is_file()
    merged = M.load_weights(final)  # the merged model loads alone
    with_adapter = PeftModel.from_pretrained(M.load_weights(cfg.model_path), final / "adapter")
    batch = cl.models.random_batch(merged.config.vocab_size, 2, 12)
    with torch.no_grad():
        diff = (merged(input_ids=batch["input_ids"]).logits - with_adapter(input_ids=batch["input_ids"]).logits).abs().max()
    assert diff < 1e-4


def test_qlora_needs_a_gpu_and_lora_refuses_full_sharding():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="--qlora needs a CUDA GPU"):
        sft.Config(model_path="m", data_dir="d", out_dir="o", qlora=True)
    with pytest.raises(ConfigError, match="not --fsdp"):
        sft.Config(model_path="m", data_dir="d", out_dir="o", lora=True, fsdp=True)
    assert sft.Config(model_path="m", data_dir="d", out_dir="o").peak_lr() == 2e-5  # a pretrained model's default
    assert sft.Config(model_path="m", data_dir="d", out_dir="o").seq_len == 2048


def test_a_run_that_cannot_fit_its_budget_stops_before_loading(work, tmp_path, capsys):
    message = one_line_error(config(work, "x", memory_budget=0.001, out_dir=str(tmp_path / "o")), capsys)
    assert "predicted peak" in message and "over the budget of 0.00 GB" in message and "--act-ckpt" in message
    assert not (tmp_path / "o").exists()
