"""Unit tests of the mixed-precision helpers: course_lib.parallel.precision (torch) and course_lib.workbook.keras_precision (Keras)."""
import pytest
import torch

from course_lib.memory import measure
from course_lib.parallel import precision


def test_format_table_matches_ieee():
    t = precision.format_table()
    assert t["fp16"]["max"] == 65504.0 and t["fp16"]["mantissa_bits"] == 10
    assert t["bf16"]["mantissa_bits"] == 7 and t["fp32"]["mantissa_bits"] == 23
    assert t["fp16"]["min_subnormal"] == pytest.approx(2.0**-24)
    assert t["bf16"]["min_normal"] == t["fp32"]["min_normal"]


def test_autocast_and_scaler_pick_by_dtype():
    assert precision.autocast_dtype("cpu") == torch.bfloat16
    assert not precision.grad_scaler("cpu", torch.bfloat16).is_enabled()
    assert not precision.grad_scaler("cpu", torch.float32).is_enabled()
    assert precision.grad_scaler("cpu", torch.float16).is_enabled()
    lin = torch.nn.Linear(8, 8)
    with precision.autocast("cpu", torch.float32):
        assert lin(torch.randn(2, 8)).dtype == torch.float32
    with precision.autocast("cpu", torch.bfloat16):
        assert lin(torch.randn(2, 8)).dtype == torch.bfloat16
    assert precision.short_name(torch.bfloat16) == "bf16" and precision.short_name(torch.int64) == "int64"


def test_saved_by_module_attributes_and_dedups():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(5, 16)
    table, out = precision.saved_by_module(model, lambda: model(x).sum())
    # fp32: Linear saves its input (x, then ReLU's output), ReLU its output: shared with the 2nd Linear's input
    assert table == {("Linear", "fp32"): x.nbytes, ("ReLU", "fp32"): 5 * 32 * 4}
    out.backward()
    with precision.autocast("cpu", torch.bfloat16):
        table16, _ = precision.saved_by_module(model, lambda: model(x).sum())
    # autocast: the bf16 cast of x and of the 2nd weight (the 1st weight is not needed: x needs no gradient);
    # ReLU keeps its bf16 output, which the 2nd Linear shares
    assert table16 == {("Linear", "bf16"): 2 * (5 * 16 + 32 * 4), ("ReLU", "bf16"): 2 * 5 * 32}
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # hooks removed


def test_grad_scaler_skips_an_overflowing_step_on_cpu():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = precision.grad_scaler("cpu", torch.float16, init_scale=2.0**4)
    before = model.weight.detach().clone()
    scaler.scale(model(torch.randn(3, 4)).sum() * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(before, model.weight) and scaler.get_scale() == 2.0**3


def test_keras_dtype_audit_flags():
    keras = pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    from course_lib.workbook import keras_precision as kp

    def build(head=None, first=None):
        inp = keras.Input((4,))
        x = keras.layers.Dense(8, dtype=first)(inp)
        return keras.Model(inp, keras.layers.Dense(3, activation="softmax", dtype=head)(x))

    with kp.dtype_policy("mixed_bfloat16"):
        bad, good, pure = build(), build(head="float32"), build(head="float32", first="bfloat16")
    assert keras.config.dtype_policy().name == "float32"   # restored after the block
    flags = lambda m: sorted({f for row in kp.dtype_audit(m) for f in row["flags"]})  # noqa: E731
    assert flags(bad) == ["16-bit output", "16-bit softmax"]
    assert flags(good) == []
    assert flags(pure) == ["16-bit weights"]
    rows = kp.dtype_audit(good)
    assert [r["output"] for r in rows] == [False, True] and rows[0]["compute"] == "bfloat16"


def test_counting_saved_tensors_frees_the_graph_with_the_loss():
    """Counting what autograd saves must not keep it alive: exp saves its own output, and a pack hook that hands that
    very tensor back ties it to its graph node in a cycle the garbage collector cannot see (on a GPU the graphs of a
    chapter's measuring cells piled up until a later step ran out of memory)."""
    import gc
    import weakref

    lin, kept = torch.nn.Linear(4, 4), []

    def forward():
        y = torch.exp(lin(torch.randn(3, 4)))
        kept.append(weakref.ref(y))
        return y.sum()

    _, out = precision.saved_by_module(lin, forward)
    del out
    with measure.SavedTensors(lin):
        forward().sum()
    gc.collect()
    assert [ref() for ref in kept] == [None, None]
