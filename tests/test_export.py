"""The SFT recipe's export (course_lib/recipes/sft.py, `backend.export`) is laid out as the checkpoint it was trained
from, on one process (here) and under FSDP2 (one 2-rank launch): the same tensor names (a tied head stored once, as
`save_pretrained` stores it), the source's `use_cache` (training turns the KV cache off in the model's config) and
its generation_config.json (sampling settings that a sharded backend, which builds the model from its config, never
loaded); and it holds the final checkpoint's weights (the same logits). The export comes before the final
generation, which gathers the whole model on every rank: a run that dies there has its model on disk."""
import json
from pathlib import Path

import pytest
from conftest import SAMPLING, assert_export_is_the_checkpoint, downloaded_like_checkpoint, tensor_names

import course_lib as cl
from course_lib.sft import model_dir as M
from course_lib.recipes import sft

pytestmark = pytest.mark.xdist_group("export")  # one worker: the runs below are made once, for all the tests

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
# as Qwen2.5-Instruct ships: sampling on, its own temperature, top-p and top-k (none of them transformers' defaults)
STEPS = 2


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Training data and a tiny checkpoint made as a downloaded Qwen2.5-Instruct is: the KV cache on in its config,
    its own sampling settings in generation_config.json."""
    root = tmp_path_factory.mktemp("export")
    base = downloaded_like_checkpoint(root, TINY)
    return root, base


def recipe_config(work, name: str, **kw) -> sft.Config:
    root, base = work
    settings = dict(steps=STEPS, micro_batch=4, seq_len=96, lr=1e-3, eval_n=2, precision="fp32", progress=False,
                    threads=1)
    return sft.Config(model_path=str(base), data_dir=str(root / "data"), out_dir=str(root / name), **{**settings, **kw})


@pytest.fixture(scope="module", params=["single", pytest.param("fsdp", marks=[pytest.mark.slow, pytest.mark.timeout(600)])])
def run(request, work):
    """(out_dir, result) of a short run that checkpoints its last step and exports: in this process, or FSDP2 on 2
    ranks (the model built on the meta device from its config, so nothing of the source's generation_config.json
    reaches it but what the export copies)."""
    if request.param == "single":
        cfg = recipe_config(work, "single")
        res = sft.train(cfg)
    else:
        cfg = recipe_config(work, "fsdp", fsdp=True)
        res = cl.launch(cfg, nproc=2, launcher="torchrun", timeout=300, env={"OMP_NUM_THREADS": "1"}).result
        assert res["backend"] == "fsdp" and res["world_size"] == 2
    return Path(cfg.out_dir), res


def test_the_export_holds_the_sources_tensors_once(run, work):
    out, _ = run
    source = tensor_names(work[1])
    assert "lm_head.weight" not in source  # the tied head: the embedding, stored once
    exported = tensor_names(out / "final")
    assert len(exported) == len(source) and exported == source, sorted(set(exported) ^ set(source))


def test_the_export_keeps_the_sources_use_cache(run, work):
    out, _ = run
    assert read_json(work[1] / "config.json")["use_cache"] is True
    assert read_json(out / "final" / "config.json")["use_cache"] is True, "the export turned the KV cache off"


def test_the_export_keeps_the_sources_generation_config(run, work):
    out, _ = run
    source = read_json(work[1] / "generation_config.json")
    assert {k: source[k] for k in SAMPLING} == SAMPLING
    assert read_json(out / "final" / "generation_config.json") == source


def test_the_exported_model_has_the_final_checkpoints_logits(run, work):
    out, _ = run
    assert_export_is_the_checkpoint(out / "final", work[1], out / f"checkpoint-{STEPS:06d}")


def test_the_run_exports_before_its_final_evaluation(run):
    out, res = run
    assert list(res["phase_seconds"]) == ["loaded", "trained", "exported", "evaluated"]
    # and it went on to the final held-out loss and samples after exporting
    assert res["final_dir"] == str(out / "final") and res["eval"][-1]["step"] == STEPS and res["samples"]
    assert (out / "samples.jsonl").is_file()


def test_a_run_whose_final_generation_dies_has_exported_first(work, monkeypatch):
    """Sharded, generation gathers the whole model on every rank: a rank that runs out of memory there ends the run,
    with the trained model already exported."""
    def out_of_memory(*args, **kwargs):
        raise MemoryError("gathering the whole model to generate")

    monkeypatch.setattr(sft, "generate_samples", out_of_memory)
    cfg = recipe_config(work, "dies", steps=1, save=False)
    with pytest.raises(MemoryError):
        sft.train(cfg)
    final = Path(cfg.out_dir) / "final"
    assert cl.checkpoint.is_complete(final) and tensor_names(final) == tensor_names(work[1])
    M.load_model(final)  # whole: weights and tokenizer


def test_the_tokenizer_is_part_of_the_atomic_export(work, tmp_path):
    """A complete export has its tokenizer: one that fails to save leaves no export that looks complete."""
    class Failing:
        def save_pretrained(self, directory):
            raise OSError("no space left on device")

    model = M.load_weights(work[1])
    with pytest.raises(OSError):
        cl.checkpoint.save_full(tmp_path / "final", model, source=work[1], tokenizer=Failing())
    assert not cl.checkpoint.is_complete(tmp_path / "final")
    cl.checkpoint.save_full(tmp_path / "final", model, source=work[1], tokenizer=M.load_tokenizer(work[1]))
    M.load_model(tmp_path / "final")  # whole: weights and tokenizer


def base_like(source: Path, into: Path) -> Path:
    """`source` set up as a Qwen2.5 *base* checkpoint is: eos `<|endoftext|>` (in the tokenizer and in
    generation_config.json), and, as some checkpoints ship, no pad token."""
    import shutil

    shutil.copytree(source, into)
    settings = read_json(into / "tokenizer_config.json")
    (into / "tokenizer_config.json").write_text(json.dumps({**settings, "eos_token": "<|endoftext|>",
                                                            "pad_token": None}))
    generation = read_json(into / "generation_config.json")
    (into / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": 0, "pad_token_id": None}))
    return into


def generate_plainly(directory: Path, new_tokens: list[int]) -> list[int]:
    """What plain transformers generates from an exported directory (AutoModelForCausalLM, AutoTokenizer, its chat
    template, its generation_config as it is) when the model's greedy choices are `new_tokens`, one a step: the new
    tokens, up to where generate stops."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    class Chooses(LogitsProcessor):
        def __call__(self, input_ids, scores):
            forced = torch.full_like(scores, -math.inf)
            forced[:, new_tokens[min(input_ids.shape[1] - start, len(new_tokens) - 1)]] = 0
            return forced

    model = AutoModelForCausalLM.from_pretrained(directory)
    tok = AutoTokenizer.from_pretrained(directory)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Reverse 12"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    start = prompt["input_ids"].shape[1]
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False, logits_processor=LogitsProcessorList([Chooses()]))
    return out[0, start:].tolist()


def test_an_export_of_a_base_checkpoint_stops_at_the_end_of_turn(work, tmp_path):
    """The fine-tune trains `<|im_end|>` at the end of every answer; a base checkpoint's eos is `<|endoftext|>`. Its
    export stops plain `generate` at the end of turn (generation_config lists it beside the eos, the tokenizer's eos
    is it), where the source as it came runs on to max_new_tokens; the pad token the recipe borrowed is not saved."""
    source = base_like(work[1], tmp_path / "base")
    tok = M.load_tokenizer(source)
    end, digit = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("1")
    assert tok.eos_token == "<|endoftext|>" and tok.pad_from_eos
    answer = [digit, digit, end, digit]  # "11", the end of turn, then whatever the model would go on with
    assert len(generate_plainly(source, answer)) == 8  # as it came: no stop at the end of turn
    cl.checkpoint.save_full(tmp_path / "final", M.load_weights(source), source=source, tokenizer=tok)
    generation = read_json(tmp_path / "final" / "generation_config.json")
    assert generation["eos_token_id"] == [0, end]
    assert {k: generation[k] for k in SAMPLING} == SAMPLING  # the rest of the source's settings kept
    settings = read_json(tmp_path / "final" / "tokenizer_config.json")
    assert settings["eos_token"] == "<|im_end|>" and settings["pad_token"] is None
    assert generate_plainly(tmp_path / "final", answer) == [digit, digit, end]
