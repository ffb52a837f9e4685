"""Every exercise's checker, tested both ways and apart from the notebooks' runs: for each reference solution
(course_lib/workbook/solutions/NN.py) its answer, rounded as the checker promises, is accepted (also as a numpy value and a
tensor); a value derived here by hand from the question (not by the solution's code) is accepted; every listed
mistake is refused with its own hint; and no hint holds a line of its solution.

The references run on a namespace built here: the course's functions, the few functions a chapter defines
(taken from its notebook), and small stand-ins for what a chapter measures (its `rows`, `counts`, ...)."""
import ast
import json
import math
import re
import types

import numpy as np
import pytest
import torch

import course_lib as cl
from course_lib.workbook import exercises as E
from course_lib.paths import REPO_ROOT

GB = 1e9
NOTEBOOKS = REPO_ROOT / "notebooks"
CHAPTERS = sorted(p.stem[:2] for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
Q7 = cl.models.QWEN25["Qwen2.5-7B"]
PSI7 = cl.memory.count_params(Q7)


def notebook_defs(chapter: str, names: set, ns: dict) -> dict:
    """Run the top-level statements of chapter `chapter`'s notebook that define `names` (functions, constants,
    imports), in notebook order, in `ns`."""
    path = next(NOTEBOOKS.glob(f"{chapter}_*.ipynb"))
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        try:
            tree = ast.parse("".join(cell["source"]))
        except SyntaxError:
            continue
        for node in tree.body:
            defined = set()
            if isinstance(node, ast.FunctionDef):
                defined = {node.name}
            elif isinstance(node, ast.Assign):
                defined = {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined = {(a.asname or a.name).split(".")[0] for a in node.names}
            if defined & names:
                exec(compile(ast.Module([node], []), str(path), "exec"), ns)
    missing = names - ns.keys()
    assert not missing, f"{chapter}: the notebook no longer defines {missing}"
    return ns


def preset(chapter):
    return cl.preset("cpu", chapter)


def tiny(chapter):
    return cl.models.tiny_qwen2(**preset(chapter).model, seed=0)


class FakeData:
    """Chapter 10's `D` for a conversation of 12 tokens, 5 of them the assistant's."""
    @staticmethod
    def assistant_mask(tokenizer, messages):
        return list(range(12)), [0] * 7 + [1] * 5


def namespace(chapter: str) -> dict:
    ns = {"cl": cl, "torch": torch, "np": np, "GB": GB, "q7": Q7, "device": torch.device("cpu")}
    if chapter == "00":
        ns["P"] = preset("00")
    elif chapter == "02":
        ns["wrapped"] = {"float32": False, "mixed_float16": True, "mixed_bfloat16": False}
    elif chapter == "03":
        from torch.utils.checkpoint import checkpoint
        ns["model"] = model = tiny("03")
        ns.update(mlp=model.model.layers[0].mlp, checkpoint=checkpoint)
    elif chapter == "04":
        notebook_defs("04", {"effective_batch"}, ns)
        ns["counts"] = [96, 32, 64, 48]
    elif chapter == "05":
        ns.update(R={"params": 1_116_288}, P_ranks=preset("05"))
    elif chapter == "06":
        notebook_defs("06", {"share_kept_whole", "parameter_sizes"}, ns)
    elif chapter == "07":
        notebook_defs("07", {"zero_state_bytes"}, ns)
        ns.update(root_b=540_672, layer_b=819_200)
    elif chapter == "08":
        notebook_defs("08", {"ppl"}, ns)
    elif chapter == "09":
        notebook_defs("09", {"TARGETS", "lora_params", "psi7"}, ns)
        ns["model"] = tiny("09")
    elif chapter == "10":
        notebook_defs("10", {"plan_for", "GPUS", "fits", "lora_plan"}, ns)
        ns.update(D=FakeData, tokenizer=None, held_out=[{"messages": []}, {"messages": []}])
    elif chapter == "11":
        notebook_defs("11", {"capstone"}, ns)
        ns.update(base="bf16", rows={"bf16": {"tokens_per_s": 1000.0}, "ckpt": {"tokens_per_s": 950.0}})
    elif chapter == "12":
        ns["P"] = types.SimpleNamespace(io_slowdown=3.0)
    return ns


def lora_7b(r, targets):  # r·(d_in + d_out) a matrix, 28 layers; h = q = 3584, kv = 512, I = 18944
    dims = {"q_proj": 3584 + 3584, "k_proj": 3584 + 512, "v_proj": 3584 + 512, "o_proj": 3584 + 3584,
            "gate_proj": 3584 + 18944, "up_proj": 3584 + 18944, "down_proj": 18944 + 3584}
    return r * 28 * sum(dims[t] for t in targets)


def fp16_within(scale, rel):  # 1e-9·scale rounded onto fp16's subnormal grid (2**-24 apart), by hand
    stored = round(1e-9 * scale / 2**-24) * 2**-24
    return abs(stored / scale - 1e-9) <= rel * 1e-9


# values derived from each question by hand (not by the solution's code), for the arithmetic exercises
CLOSED = {
    "zero_gpus_32b": lambda ns: (lambda psi: {"zero2": math.ceil(14 * psi / (80e9 - 2 * psi)),
                                              "zero3": math.ceil(16 * psi / 80e9)})(
        cl.memory.count_params(cl.models.QWEN25["Qwen2.5-32B"])),
    # 28 layers x 4096 tokens x (2 bytes x (7h + 2q + 2kv + 4I) values + two norms' fp32 upcast, 2 x 2h bytes)
    "activations_7b_4k": lambda ns: 28 * 4096 * (2 * (7 * 3584 + 2 * 3584 + 2 * 512 + 4 * 18944) + 4 * 3584) / GB,
    "sgd_state_bytes": lambda ns: 12 * sum(p.numel() for p in tiny("00").parameters()),
    "bf16_ignored_update": lambda ns: 2.0**-8,
    "min_loss_scale": lambda ns: next(2**k for k in range(64) if fp16_within(2**k, 0.01)),
    "clip_before_unscale": lambda ns: 2.0**-16,
    "fp16_logit_scale": lambda ns: 2 ** int(math.log2(65504 / 8)),
    "scale_after_overflows": lambda ns: 2**15 // 8 * 4,
    "no_loss_scale_policies": lambda ns: ["float32", "mixed_bfloat16"],
    "k_star_7b": lambda ns: (28 * 2 * 3584 / (2 * (7 * 3584 + 2 * 3584 + 2 * 512 + 4 * 18944) + 4 * 3584)) ** 0.5,
    "segment_7b": lambda ns: 1,
    "reentrant_grads": lambda ns: {"reentrant": 0, "non_reentrant": 3},  # gate, up, down: weights, no biases
    "lr_at_7000": lambda ns: 2e-6 + 1.8e-5 * 0.5 * (1 - 0.5),  # 6000 of 9000 cosine steps: cos(2π/3) = -1/2
    "accum_steps_64": lambda ns: 4 * 16 * 8 // (4 * 64),
    "token_weights": lambda ns: [96 / 240, 32 / 240, 64 / 240, 48 / 240],
    "ddp_token_weight": lambda ns: {"rank0": 2 * 120 / 160, "rank1": 2 * 40 / 160},  # (w0·g0 + w1·g1)/2 = (120·g0 + 40·g1)/160
    "no_sync_elements": lambda ns: {"sync_every": 8 * 1_116_288, "no_sync": 1_116_288},
    "zero3_14b_gib": lambda ns: 16 * cl.memory.count_params(cl.models.QWEN25["Qwen2.5-14B"]) / 16 / 2**30,
    "zero2_offload_7b_gib": lambda ns: 2 * PSI7 / 2**30,
    "fsdp2_7b_64_gib": lambda ns: 16 * PSI7 / 64 / 2**30,
    "all_gathers_24": lambda ns: {"default": 49, "keep": 25},
    "gathered_peak_bf16": lambda ns: (540_672 + 819_200) // 2,
    "bubble_p4_m16": lambda ns: 3 / 19,
    "min_micro_batches": lambda ns: 134,  # 7 / (m + 7) < 1/20  <=>  m > 133
    "tp_degrees_14b": lambda ns: [1, 2, 4, 8],  # divisors of both 40 query and 8 key/value heads
    "lora_r64_7b": lambda ns: lora_7b(64, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "lora_qv_percent": lambda ns: 100 * lora_7b(8, ["q_proj", "v_proj"]) / PSI7,
    "lora_r4_optimizer_bytes": lambda ns: (lambda c: 8 * 4 * c.num_hidden_layers * (
        2 * (c.hidden_size + c.num_attention_heads * (c.hidden_size // c.num_attention_heads))
        + 2 * (c.hidden_size + c.num_key_value_heads * (c.hidden_size // c.num_attention_heads))
        + 3 * (c.hidden_size + c.intermediate_size)) + 4 * 2 * 7 * c.num_hidden_layers)(ns["model"].config),
    "answer_tokens": lambda ns: 5,
    "zero3_7b_gib": lambda ns: 16 * PSI7 / 8 / 2**30,
    "ckpt_speed_cost": lambda ns: 0.05,
    "ranking_kind": lambda ns: "no slowdown measured",
    "intensity_mul_add": lambda ns: {"eager": 1 / 12, "fused": 1 / 8},
    "io_wait_expected": lambda ns: 0.75,
    "mfu_7b_h100": lambda ns: 3000 * (6 * PSI7 + 12 * 28 * 3584 * 2048) / 989e12,
}
# no closed form: what a course function or a chapter's tool answers (a choice, a measurement, a table's reading)
NOT_ARITHMETIC = {"persistence_threshold", "buckets_at_2mib", "plan_7b_zero3_16", "lora_r64_32b_gpu"}

# the build exercises (the answer is code) are tested by running it: tests/test_builds.py
ALL = [(ch, name) for ch in CHAPTERS for name, ref in E.load_references(ch).items() if not ref.build]
_NS: dict = {}


def ns_for(chapter):
    if chapter not in _NS:
        _NS[chapter] = namespace(chapter)
    return _NS[chapter]


def rounded(value, ref):
    """The answer as a learner would type it off the chapter: 3 significant figures, or the printed digits."""
    value = E.plain(value)
    if isinstance(value, dict):
        return {k: rounded(v, ref) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, ref) for v in value]
    if isinstance(value, float) and value:
        decimals = ref.digits - 1 - math.floor(math.log10(abs(value)))
        if ref.printed:
            decimals = min(decimals, round(-math.log10(ref.printed)))
        return round(value, decimals)
    return value


def verdict(chapter, name, answer):
    return E.verdict(E.load_references(chapter)[name], answer, ns_for(chapter))


@pytest.mark.parametrize("chapter, name", ALL, ids=[f"{c}-{n}" for c, n in ALL])
def test_a_rounded_reference_answer_is_accepted(chapter, name):
    ref = E.load_references(chapter)[name]
    expected, scratch = E._run_reference(ref, ns_for(chapter), keep=True)
    scratch = {"math": math, **scratch}
    assert verdict(chapter, name, expected)[0] == "correct"
    typed = rounded(expected, ref)
    status, text = verdict(chapter, name, typed)
    inside = [m for m in ref.mistakes if E.same(eval(m.expression, scratch), expected, **ref.tolerance())
              and not E.same(eval(m.expression, scratch), expected, cap=0.0)]
    cap = min([abs(E.plain(eval(m.expression, scratch)) - E.plain(expected)) / 2 for m in inside], default=None)
    if cap is not None and abs(typed - E.plain(expected)) > cap:  # a mistake inside the band: asked for exactly
        assert status == "not yet" and "exactly" in text and ref.exact in text
    else:
        assert status == "correct", f"{name}: {typed!r} refused ({text})"
    plain = E.plain(expected)
    if isinstance(plain, (int, float)) and not isinstance(plain, bool):
        for form in (np.float64(plain), torch.tensor(plain, dtype=torch.float64), np.array(plain), [plain]):
            assert verdict(chapter, name, form)[0] == "correct", f"{name}: {form!r}"
    elif isinstance(plain, list) and all(isinstance(v, (int, float)) for v in plain):
        for form in (np.array(plain), torch.tensor(plain, dtype=torch.float64), tuple(plain)):
            assert verdict(chapter, name, form)[0] == "correct", f"{name}: {form!r}"


@pytest.mark.parametrize("chapter, name", ALL, ids=[f"{c}-{n}" for c, n in ALL])
def test_every_listed_mistake_is_refused_with_its_own_hint(chapter, name):
    ref = E.load_references(chapter)[name]
    assert ref.mistakes, f"{name}: list its likely mistakes (`# mistake: <expression> :: <hint>`)"
    expected, scratch = E._run_reference(ref, ns_for(chapter), keep=True)
    scratch = {"math": math, **scratch}
    for m in ref.mistakes:
        wrong = eval(m.expression, scratch)
        assert not E.same(wrong, expected, cap=0.0), f"{name}: the mistake {m.expression} gives the right answer"
        status, text = verdict(chapter, name, wrong)
        assert status == "not yet" and m.hint in text, f"{name}: {m.expression} -> {status} ({text})"
        typed = rounded(wrong, ref)
        if not E.same(typed, expected, **ref.tolerance()):  # typed off a printout: the same hint
            assert m.hint in verdict(chapter, name, typed)[1], f"{name}: {typed!r}"


ARITHMETIC = [(c, n) for c, n in ALL if n not in NOT_ARITHMETIC]  # the others: what the chapter's tool says


def test_every_exercise_is_derived_here_or_listed_as_not_arithmetic():
    assert {n for _, n in ALL} == set(CLOSED) | set(NOT_ARITHMETIC)


@pytest.mark.parametrize("chapter, name", ARITHMETIC, ids=[f"{c}-{n}" for c, n in ARITHMETIC])
def test_a_value_derived_by_hand_is_accepted(chapter, name):
    assert name in CLOSED, f"{name}: derive its value here, or list it as not arithmetic"
    status, text = verdict(chapter, name, CLOSED[name](ns_for(chapter)))
    assert status == "correct", f"{name}: {text}"


@pytest.mark.parametrize("chapter, name", ALL, ids=[f"{c}-{n}" for c, n in ALL])
def test_no_hint_holds_a_line_of_its_solution(chapter, name):
    ref = E.load_references(chapter)[name]
    def squash(text):
        return re.sub(r"\s+", "", text)
    hints = [squash(ref.hint)] + [squash(m.hint) for m in ref.mistakes]
    for line in ref.code.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [line] + ([line.split("=", 1)[1]] if re.match(r"^\w+\s*=[^=]", line) else [])
        for part in parts:
            if len(squash(part)) >= 12:
                assert not any(squash(part) in h for h in hints), f"{name}: a hint quotes `{part.strip()}`"


# the cases a learner typed into the notebooks: right answers refused, a wrong one accepted, wrong references
@pytest.mark.parametrize("chapter, name, answer, word", [
    ("09", "lora_qv_percent", 0.033, "correct"),
    ("11", "zero3_7b_gib", 14.2, "correct"),
    ("08", "bubble_p4_m16", 0.158, "correct"),
    ("07", "fsdp2_7b_64_gib", 1.77, "correct"),
    ("12", "intensity_mul_add", {"eager": 0.083, "fused": 0.125}, "correct"),
    ("12", "intensity_mul_add", {"eager": 0.083, "fused": 0.167}, "not yet"),
    ("11", "ranking_kind", "No slowdown", "correct"),
    ("04", "token_weights", torch.tensor([0.4, 2 / 15, 4 / 15, 0.2]), "correct"),
    ("04", "token_weights", np.array([0.4, 2 / 15, 4 / 15, 0.2]), "correct"),
    ("01", "clip_before_unscale", 1 / 65504, "not yet"),
    ("01", "clip_before_unscale", 2.0**-16, "correct"),
    ("01", "min_loss_scale", 32, "not yet"),
    ("06", "zero2_offload_7b_gib", 14.19, "correct"),
    ("06", "zero2_offload_7b_gib", (2 * PSI7 + 2 * PSI7 / 8) / 2**30, "not yet"),
    ("03", "k_star_7b", 0.929, "correct"),
    ("03", "k_star_7b", (56 / 34) ** 0.5, "not yet"),
    ("00", "activations_7b_4k", cl.memory.step_memory(Q7, precision="bf16-mixed", seq=4096)["activations"] / GB, "correct"),
    ("00", "activations_7b_4k", 26.66, "correct"),
])
def test_the_cases_learners_typed(chapter, name, answer, word):
    assert verdict(chapter, name, answer)[0] == word


def test_a_gpu_is_accepted_in_its_usual_spellings():
    expected = E._run_reference(E.load_references("10")["lora_r64_32b_gpu"], ns_for("10"))
    short = {"24 GB (RTX 4090)": "RTX 4090", "40 GB (A100-40G)": "A100-40G", "80 GB (A100/H100)": "H100",
             "141 GB (H200)": "h200"}.get(expected)
    if short:
        assert verdict("10", "lora_r64_32b_gpu", short)[0] == "correct"
    assert verdict("10", "lora_r64_32b_gpu", "does not fit" if short else "H200")[0] == "not yet"


def test_the_two_activation_counts_of_the_course_agree():
    h, V = Q7["hidden_size"], Q7["vocab_size"]
    head = 4096 * ((3 * h + V) * 2 + h * 2 + V * 2)  # the final norm and the logits, 16-bit, with fp32 upcasts
    layers = cl.memory.qwen2_activation_bytes(Q7, 4096, 1, bytes_per_value=2) - head
    assert layers == 28 * cl.memory.layer_activation_bytes(Q7, 4096, "bf16")
