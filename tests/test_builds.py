"""The build-it-yourself exercises, tested both ways: each reference solution (course_lib/workbook/solutions/NN.py,
a block marked `# build: yes`) is accepted by its check, and each bug a learner makes, planted into the reference's
text, is refused with a message that names the rank (where there are ranks), the tensor and how far off it is, never
a traceback. Every distributed check runs in one launch of two gloo ranks."""
import pytest

from course_lib.workbook import builds, exercises
from course_lib.recipes import build_check

pytestmark = pytest.mark.xdist_group("builds")  # one worker: the checks' one launch (`verdicts`) runs once

REFS = {name: ref for ch in ("01", "03", "05", "06", "07", "08", "09", "10")
        for name, ref in exercises.load_references(ch).items() if ref.build}

# exercise -> {bug: (text of the reference, what replaces it (a tuple of each: several edits), a fragment of the
# message that must refuse it)}
BUGS = {
    "LossScaler": {
        "the step taken despite an inf": ("        if not self.found_inf:\n            optimizer.step()",
                                          "        optimizer.step()",
                                          "tensor 'weight' after step 3: largest difference inf"),
        "the gradients left scaled": ("            g.div_(self.scale_)\n", "            pass\n",
                                      "tensor 'weight' after step 1: largest difference"),
        "the clean-step count kept after an overflow": ("self.scale_ * self.backoff, 0",
                                                        "self.scale_ * self.backoff, self.clean",
                                                        "scale after step 4: 1024.0, expected 256.0"),
    },
    "checkpointed": {
        "the output saved as well": ("        ctx.save_for_backward(x)\n        return block(x)",
                                     "        out = block(x)\n        ctx.save_for_backward(x, out)\n"
                                     "        return out",
                                     "bytes saved for backward: 4096, expected 2048"),
        "gradients left off in backward": ("        with torch.enable_grad():\n            out = ctx.block(x)",
                                           "        out = ctx.block(x)", "your code raised RuntimeError: element 0"),
        "the input kept as an attribute of ctx": (("        ctx.save_for_backward(x)\n", "ctx.saved_tensors[0]"),
                                                  ("        ctx.x = x\n", "ctx.x"),
                                                  "bytes saved for backward: 0; keep the input with "
                                                  "ctx.save_for_backward"),
        "no Function at all": ("return Checkpoint.apply(block, x)", "return block(x)",
                               "bytes saved for backward: 51200, expected 2048"),
    },
    "assistant_mask": {
        "the end-of-turn token left out": ("stop = text.find(end, start) + len(end)", "stop = text.find(end, start)",
                                           "conversation 1, token 39 ('<|im_end|>'): your mask 0, expected 1"),
        "the role header trained": ("        start += len(header)\n", "",
                                    "conversation 1, token 22 ('<|im_start|>'): your mask 1, expected 0"),
        "the content only, not the template's think block": (
            "        start += len(header)\n",
            "        start += len(header)\n        if text.startswith('<think>', start):\n"
            "            start = text.index('</think>', start) + len('</think>\\n\\n')\n",
            "conversation 1, token 54 ('<think>'): your mask 0, expected 1"),
        "apply_chat_template's tokenized dict as the ids": (
            "    return list(enc[\"input_ids\"]), mask",
            "    return tokenizer.apply_chat_template(messages, tokenize=True), mask",
            "your ids are a dict"),
        "the last turn only": ("    mask = [int(", "    spans = spans[-1:]\n    mask = [int(",
                               "conversation 1, token 25 ('The'): your mask 0, expected 1"),
    },
    "ZeroOneAdamW": {
        "every rank keeps all the state": ("own = [p for p, r in zip(self.params, self.owner) if r == rank]",
                                           "own = self.params",
                                           "rank 0 holds 1,712 bytes of optimizer state, rank 1 1,712"),
        "updated parameters never sent": ("            dist.broadcast(p.data, src=r)", "            pass",
                                          "rank 0, tensor '0.bias' after step 1: largest difference"),
        "every parameter sent from rank 0": ("src=r)", "src=0)", "tensor '0.bias' after step 1: largest difference"),
    },
    "ShardedLinear": {
        "the gradient summed, not averaged": ("return shard / world", "return shard",
                                              "rank 0, tensor 'weight.grad' at step 1: largest difference"),
        "the whole layer kept on every rank": ("rows = linear.out_features // world", "rows = linear.out_features",
                                               "rank 0, tensor 'weight' (this rank's rows): shape (6, 8), "
                                               "expected (3, 8)"),
        "the rank's own gradient, not reduced": (
            "        shard = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))\n"
            "        dist.reduce_scatter_tensor(shard, grad.contiguous())\n",
            "        rows = grad.shape[0] // world\n        shard = grad[dist.get_rank() * rows:][:rows].clone()\n",
            "rank 0, tensor 'weight.grad' at step 1: largest difference"),
    },
    "tp_mlp": {
        "fc2's bias added on every rank": ("F.linear(F.gelu(self.fc1(SumInBackward.apply(x))), self.fc2.weight)",
                                           "self.fc2(F.gelu(self.fc1(SumInBackward.apply(x)))) - self.fc2.bias / 2",
                                           "rank 0, output: largest difference"),
        "a sum in backward after fc2 too": ("    def backward(ctx, grad):\n        return grad\n",
                                            "    def backward(ctx, grad):\n        grad = grad.clone()\n"
                                            "        dist.all_reduce(grad)\n        return grad\n",
                                            "rank 0, tensor 'fc1.weight.grad': largest difference"),
        "no sum of the input's gradient": ("self.fc1(SumInBackward.apply(x))", "self.fc1(x)",
                                           "rank 0, tensor 'x.grad': largest difference"),
    },
    "LoRALinear": {
        "the base layer left trainable": ("        self.base.requires_grad_(False)\n", "", "trainable parameters: 316"),
        "A starts at zero": ("nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))", "nn.init.zeros_(self.A)",
                             "tensor 'B.grad' at the start: all zero"),
        "scaled by alpha, not alpha / r": ("alpha / r", "alpha", "output with A and B set to peft's: largest"),
        "B starts random": ("torch.zeros(base.out_features, r)", "torch.randn(base.out_features, r)",
                            "output at the start: largest difference"),
        "A and B multiplied in the wrong order": ("self.A.T @ self.B.T", "self.A @ self.B",
                                                  "your code raised RuntimeError: mat1 and mat2"),
    },
    "ddp_from_hooks": {
        "no broadcast of the starting state": ("        dist.broadcast(p.data, src=0)\n", "        pass\n",
                                               "rank 1, tensor '0.weight' after wrapping: largest difference"),
        "no division by the number of ranks": ("grad / world", "grad",
                                               "rank 0, tensor '0.weight.grad' at step 1: largest difference"),
        "the hook averages but returns the local gradient": ("return grad / world", "grad / world",
                                                             "rank 0, tensor '0.weight.grad' at step 1"),
    },
}


def planted(name: str) -> dict:
    cells = {"reference": REFS[name].code}
    for bug, (old, new, _) in BUGS.get(name, {}).items():
        code = REFS[name].code
        for o, n in zip(*((old, new) if isinstance(old, tuple) else ((old,), (new,)))):  # one edit, or several
            assert o in code, f"{name}: the planted bug {bug!r} no longer matches the reference"
            code = code.replace(o, n, 1)
        cells[bug] = code
    return cells


@pytest.fixture(scope="module")
def verdicts():
    return builds.run({name: planted(name) for name in REFS})


def test_every_build_exercise_has_a_check_a_reference_and_two_planted_bugs():
    assert set(REFS) == set(build_check.CHECKS)
    assert all(len(BUGS.get(name, {})) >= 2 for name in REFS), {n: len(BUGS.get(n, {})) for n in REFS}


@pytest.mark.parametrize("name", sorted(REFS))
def test_the_reference_is_accepted(verdicts, name):
    assert verdicts[name]["reference"] is None, verdicts[name]["reference"]


@pytest.mark.parametrize("name, bug", [(n, b) for n in sorted(BUGS) for b in BUGS[n]])
def test_a_planted_bug_is_refused_with_where_and_how_far(verdicts, name, bug):
    message = verdicts[name][bug]
    assert message is not None, f"{name}: {bug} was accepted"
    assert BUGS[name][bug][2] in message, message
    assert "Traceback" not in message and len(message.splitlines()) == 1


def test_a_cell_that_defines_nothing_or_does_not_compile_is_answered_in_one_line():
    assert build_check.verdict("LoRALinear", "x = 1\n") == "your cell defines no `LoRALinear`"
    assert build_check.verdict("LoRALinear", "def LoRALinear(:\n").startswith("your cell raised SyntaxError")


def test_in_a_notebook_the_learners_last_run_of_the_cell_is_checked(tmp_path, monkeypatch, capsys):
    """The learner's path: the check reads the cell from IPython's history (not the reference), the last run of it."""
    from IPython.core.interactiveshell import InteractiveShell

    from course_lib.workbook.results import Ledger

    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path))
    ledger = Ledger("09_lora", profile="cpu", device="cpu")  # (made before the shell: no section tables)
    shell = InteractiveShell.instance()
    try:
        shell.user_ns.update(ledger=ledger, exercises=exercises)
        shell.run_cell("ex = exercises.Exercises(ledger, chapter='09')")
        wrong = REFS["LoRALinear"].code.replace("alpha / r", "alpha")
        for cell in ("# Exercise LoRALinear: mine\nLoRALinear = ...\n", "# Exercise LoRALinear: mine\n" + wrong,
                     "# Exercise LoRALinear: mine\n" + REFS["LoRALinear"].code):
            shell.run_cell(cell, store_history=True)  # as a notebook runs a cell
            shell.run_cell('ex.check("LoRALinear")', store_history=True)
        said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("exercise LoRALinear")]
        assert [s.split(": ")[1][:7] for s in said] == ["skipped", "not yet", "correct"], said
        assert "output with A and B set to peft's" in said[1]
    finally:
        InteractiveShell.clear_instance()


def test_without_qwens_tokenizer_the_mask_is_checked_with_the_courses_own(monkeypatch, capsys):
    """No npm and no cached copy (the course image, a learner offline): the check still answers, under the course's
    small ChatML tokenizer, and says so; it still refuses a wrong mask."""
    def missing(*_):
        raise RuntimeError("npm not found")

    monkeypatch.setattr(build_check.cl.tokenizer, "fetch_qwen_tokenizer", missing)
    cells = planted("assistant_mask")
    assert build_check.verdict("assistant_mask", cells["reference"]) is None
    assert "checked with the course's small ChatML tokenizer" in capsys.readouterr().out
    for bug in ("the end-of-turn token left out", "the role header trained"):
        message = build_check.verdict("assistant_mask", cells[bug])
        assert message is not None and "your mask" in message, (bug, message)
