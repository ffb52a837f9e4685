"""course_lib.parallel.zero: the shipped DeepSpeed configs, resolving "auto", one-line errors, and one short
2-rank ZeRO-3 launch that checks the bytes a rank holds against the ZeRO paper (chapter 06)."""
import json

import pytest

import course_lib as cl
from course_lib.parallel import zero

RUN = dict(micro_batch=2, accum_steps=2, hidden_size=128, lr=1e-3, precision="bf16")


@pytest.mark.parametrize("name", zero.CONFIGS)
def test_shipped_configs_resolve_and_validate(name):
    raw = zero.load_config(name)
    assert "auto" in json.dumps(raw), "the configs use HF-Trainer-style auto values"
    cfg = zero.prepare(name, 2, **RUN)
    assert "auto" not in json.dumps(cfg)
    assert cfg["train_batch_size"] == 2 * 2 * 2
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    assert cfg["optimizer"]["params"]["torch_adam"] is True  # never JIT-compile DeepSpeed's Adam
    zo = cfg["zero_optimization"]
    assert zo["stage"] == int(name[4])
    if zo["stage"] >= 1:
        assert zo["reduce_bucket_size"] == 128 * 128
    if zo["stage"] == 3:
        assert zo["stage3_param_persistence_threshold"] == 10 * 128
        assert zo["stage3_prefetch_bucket_size"] == int(0.9 * 128 * 128)
    assert raw == zero.load_config(name), "resolve_auto must not change the loaded dict"


def test_persistence_threshold_override_sets_both():
    zo = zero.prepare("zero3", 2, persistence_threshold=0, **RUN)["zero_optimization"]
    assert zo["stage3_param_persistence_threshold"] == 0 and zo["model_persistence_threshold"] == 0
    assert "model_persistence_threshold" not in zero.prepare("zero2", 2, persistence_threshold=0, **RUN)["zero_optimization"]


def test_fp32_disables_both_16bit_modes():
    cfg = zero.prepare("zero1", 2, **{**RUN, "precision": "fp32"})
    assert not cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]


def _error(cfg, ranks=2) -> str:
    with pytest.raises(zero.ZeroConfigError) as e:
        zero.validate(cfg, ranks)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_bad_configs_give_one_line_errors():
    good = zero.prepare("zero2", 2, **RUN)
    assert "stage must be 0, 1, 2 or 3" in _error({**good, "zero_optimization": {"stage": 4}})
    msg = _error({**good, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 4)
    assert "train_batch_size 8" in msg and "= 32" in msg
    assert "offload_param needs stage 3" in _error({**good, "zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}})
    assert "offload_optimizer needs stage 1" in _error({**good, "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    assert "gradient_clipping" in _error({**good, "gradient_clipping": "auto"})
    assert "both enabled" in _error({**good, "fp16": {"enabled": True}})
    assert "train_micro_batch_size_per_gpu" in _error({k: v for k, v in good.items() if k != "train_micro_batch_size_per_gpu"})
    # offload to "none" is no offload
    zero.validate({**good, "zero_optimization": {"stage": 1, "offload_param": {"device": "none"}}}, 2)


@pytest.mark.skipif(cl.supports_fp16(), reason="fp16 is allowed on a GPU")
def test_fp16_and_compiled_adam_rejected_on_cpu():
    good = zero.prepare("zero2", 2, **RUN)
    assert "fp16 needs a GPU in this course" in _error({**good, "bf16": {"enabled": False}, "fp16": {"enabled": True}})
    no_torch_adam = {**good, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert "torch_adam" in _error(no_torch_adam)


def test_unknown_config_name():
    with pytest.raises(zero.ZeroConfigError, match="zero2_offload"):
        zero.load_config("zero9")


def test_zero3_launch_holds_16_psi_over_n():
    """One short 2-rank launch: ZeRO-3 bf16 holds exactly (2 + 2 + 12)Ψ/N per rank (+4 B step counter)."""
    model = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=256)
    from course_lib.recipes import zero as recipe

    cfg = recipe.Config.from_preset(cl.preset("cpu", chapter="06"), configs="zero3", steps=1, accum=1, seq_len=16,
                                    persistence_threshold=0, **model)
    run = cl.launch(cfg, nproc=2, launcher="torchrun", quiet=True, timeout=300)
    r = run.result["runs"][0]
    psi = cl.memory.count_params(cfg.size())
    assert r["num_params"] == psi
    theory = cl.memory.zero_state_bytes(psi, 3, 2)
    for held in r["ranks"]:
        assert held["params"] == theory["params"]
        assert held["grads_kept"] == theory["grads"]
        assert held["optimizer"] == theory["optimizer"] + 4


def test_a_value_set_in_the_config_and_on_the_command_line_must_agree():
    cfg = zero.load_config("zero2")
    cfg["optimizer"]["params"]["lr"] = 1e-5
    cfg["gradient_accumulation_steps"] = 4
    with pytest.raises(zero.ZeroConfigError) as err:
        zero.resolve_auto(cfg, world_size=2, micro_batch=2, accum_steps=1, hidden_size=64, lr=2e-5)
    message = str(err.value)
    assert "optimizer.params.lr=1e-05 (the run: 2e-05)" in message and "gradient_accumulation_steps=4" in message
    assert "\n" not in message
    same = zero.resolve_auto(cfg, world_size=2, micro_batch=2, accum_steps=4, hidden_size=64, lr=1e-5)
    assert same["optimizer"]["params"]["lr"] == 1e-5  # agreeing values are fine
