"""The build-it-yourself exercises, tested both ways: each reference solution (course_lib/workbook/solutions/NN.py,
a block marked `# build: yes`) and a correct answer written otherwise (tests/builds/alternatives.py) are accepted by
its check, and each mistake a learner makes, planted into the reference's text, is refused with a message that
names the rank (where there are ranks), the tensor, how far off it is and what that points at, never a traceback.
All of them run in one launch (the distributed checks on three gloo ranks); the limits in a second."""
import importlib.util
from pathlib import Path

import pytest

from course_lib.workbook import builds, exercises
from course_lib.recipes import build_check

pytestmark = pytest.mark.xdist_group("builds")  # one worker: the checks' one launch (`verdicts`) runs once

REFS = {name: ref for ch in ("01", "03", "05", "06", "07", "08", "09", "10")
        for name, ref in exercises.load_references(ch).items() if ref.build}
_spec = importlib.util.spec_from_file_location("alternatives", Path(__file__).parent / "builds" / "alternatives.py")
_alternatives = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_alternatives)
ALTERNATIVES = _alternatives.ALTERNATIVES

# exercise -> {mistake: (text of the reference, what replaces it (a tuple of each: several edits), fragments of the
# message that must refuse it (a string, or a tuple of strings all in the message))}
BUGS = {
    "LossScaler": {
        "the step taken despite an inf": (
            "        if not self.found_inf:\n            optimizer.step()", "        optimizer.step()",
            ("tensor 'weight' after step 5: 6 of 18 values are inf or NaN", "skip optimizer.step()")),
        "the gradients left scaled": (
            "            g.div_(self.scale_)\n", "            pass\n",
            ("tensor 'weight' after step 1", "still multiplied by the scale (1024× GradScaler's)")),
        "the clean-step count kept after an overflow": (
            "self.scale_ * self.backoff, 0", "self.scale_ * self.backoff, self.clean",
            "scale after step 7: 4096, expected 1024; yours grew here and GradScaler did not"),
        "the count not started again after a growth": (
            ("if self.clean == self.interval:", "self.scale_, self.clean = self.scale_ * self.growth, 0"),
            ("if self.clean >= self.interval:", "self.scale_ = self.scale_ * self.growth"),
            "scale after step 4: 16384, expected 4096; yours grew here"),
        "inf looked for, NaN not": (
            "self.found_inf = not all(torch.isfinite(g).all() for g in grads)",
            "self.found_inf = any(torch.isinf(g).any() for g in grads)",
            ("scale after step 12", "the gradients held a NaN")),
        "the overflow looked for in the loss": (
            ("        self.found_inf = not all(torch.isfinite(g).all() for g in grads)\n",
             "        return loss * self.scale_"),
            ("", "        self.found_inf = not torch.isfinite(loss).item()\n        return loss * self.scale_"),
            ("scale after step 5", "the loss itself was finite")),
        "the gradients zeroed, the step taken": (
            "        if not self.found_inf:\n            optimizer.step()",
            "        if self.found_inf:\n            for g in grads:\n                g.zero_()\n        optimizer.step()",
            ("tensor 'weight' after step 5", "a step on zeroed gradients still moves the weights")),
        "the default factors": (
            "init_scale, growth_factor, backoff_factor, growth_interval", "init_scale, 2.0, 0.5, growth_interval",
            ("scale after step 3: 2048, expected 4096", "use the factors passed")),
        "a growth one step late": (
            "if self.clean == self.interval:", "if self.clean > self.interval:",
            "scale after step 3: 1024, expected 4096; GradScaler grew it here"),
    },
    "checkpointed": {
        "the output saved as well": (
            "        ctx.save_for_backward(x)\n        return block(x)",
            "        out = block(x)\n        ctx.save_for_backward(x, out)\n        return out",
            "bytes saved for backward: 2880, expected 1440; forward keeps only the input"),
        "gradients left off in backward": (
            "        with torch.enable_grad():\n            out = ctx.block(x)", "        out = ctx.block(x)",
            ("your code raised RuntimeError: element 0", "under torch.enable_grad()")),
        "the input kept as an attribute of ctx": (
            ("        ctx.save_for_backward(x)\n", "ctx.saved_tensors[0]"), ("        ctx.x = x\n", "ctx.x"),
            "bytes saved for backward: 0; keep the input with ctx.save_for_backward"),
        "no Function at all": ("return Checkpoint.apply(block, x)", "return block(x)",
                               ("bytes saved for backward:", "expected 1440")),
        "the saved input reused without detach": (
            "        x = x.detach().requires_grad_(True)\n", "",
            ("tensor 'x.grad' (the input a leaf)", "its gradient reached x twice")),
        "torch.autograd.grad: the weights get nothing": (
            "        torch.autograd.backward(out, grad_out)\n        return None, x.grad",
            "        (gx,) = torch.autograd.grad(out, x, grad_out)\n        return None, gx",
            ("tensor 'block.0.weight.grad' (the input a leaf): none", "not torch.autograd.grad")),
        "the output's gradient returned as the input's": (
            "return None, x.grad", "return None, grad_out",
            "tensor 'x.grad' (the input a leaf): largest difference"),
    },
    "assistant_mask": {
        "the end-of-turn token left out": (
            "stop = text.find(end, start) + len(end)", "stop = text.find(end, start)",
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
        "the newline after <|im_end|> trained": (
            "stop = text.find(end, start) + len(end)", "stop = text.find(end, start) + len(end) + 1",
            ("your mask 1, expected 0", "the newline after <|im_end|> belongs to no turn")),
    },
    "ZeroOneAdamW": {
        "every rank keeps all the state": ("own = [p for p, r in zip(self.params, self.owner) if r == rank]",
                                           "own = self.params",
                                           ("rank 0 holds 1,200 bytes of optimizer state",
                                            "each rank keeps the state of its own share only")),
        "a full-size buffer kept between steps": (
            "        self.optimizer = torch.optim.AdamW(own, lr=lr, weight_decay=weight_decay)",
            "        self.optimizer = torch.optim.AdamW(own, lr=lr, weight_decay=weight_decay)\n"
            "        self.flat = torch.cat([p.detach().flatten() for p in self.params])",
            ("together 2.48×", "a full-size buffer kept between steps")),
        "updated parameters never sent": ("            dist.broadcast(p.data, src=r)", "            pass",
                                          ("rank 0, tensor '0.bias' after step 1", "did not change at this step")),
        "every parameter sent from rank 0": ("src=r)", "src=0)", ("tensor '0.bias' after step 1", "did not change")),
        "weight_decay not passed on": ("lr=lr, weight_decay=weight_decay)", "lr=lr)",
                                       ("tensor '0.weight' after step 1", "weight_decay=0.01, its default")),
        "Adam's L2 penalty for AdamW's decay": ("torch.optim.AdamW(own", "torch.optim.Adam(own",
                                                ("after step 1", "Adam, whose weight decay is an L2 term")),
        "the averaged gradients summed again": (
            "        self.optimizer.step()\n",
            "        for p in self.params:\n            dist.all_reduce(p.grad)\n        self.optimizer.step()\n",
            ("tensor '0.weight.grad' after step 1", "3.00× what they were")),
        "owners computed for two ranks": ("self.owner = [i % world", "self.owner = [i % 2",
                                          ("rank 2, your code raised ValueError: optimizer got an empty parameter "
                                           "list", "this rank owns nothing")),
    },
    "ShardedLinear": {
        "the gradient summed, not averaged": ("return shard / world", "return shard",
                                              ("rank 0, tensor 'weight.grad' at step 1",
                                               "3.00× fully_shard's: summed over the 3 ranks, not averaged?")),
        "divided by 2, not by the number of ranks": ("return shard / world", "return shard / 2",
                                                     "1.50× fully_shard's: divided by 2, not by the number of ranks"),
        "the whole layer kept on every rank": ("rows = linear.out_features // world", "rows = linear.out_features",
                                               "rank 0, tensor 'weight' (this rank's rows): shape (9, 7), "
                                               "expected (3, 7)"),
        "the bias not cut": ("self.bias = nn.Parameter(linear.bias.detach()[rank * rows:(rank + 1) * rows].clone())",
                             "self.bias = nn.Parameter(linear.bias.detach().clone())",
                             ("tensor 'bias' (this rank's rows): shape (9,), expected (3,)", "the bias is cut")),
        "the rows of another rank": (
            ("[rank * rows:(rank + 1) * rows]", "[rank * rows:(rank + 1) * rows]"),
            ("[(world - 1 - rank) * rows:(world - rank) * rows]", "[(world - 1 - rank) * rows:(world - rank) * rows]"),
            "rank 0, tensor 'weight' (this rank's rows): largest difference"),
        "the rank's own gradient, not reduced": (
            "        shard = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))\n"
            "        dist.reduce_scatter_tensor(shard, grad.contiguous())\n        return shard / world",
            "        rows = grad.shape[0] // world\n        return grad[dist.get_rank() * rows:][:rows].clone()",
            ("rank 0, tensor 'weight.grad' at step 1", "yours is this rank's own gradient")),
        "the gather outside autograd": (
            "GatherRows.apply(self.weight), GatherRows.apply(self.bias)",
            "GatherRows.apply(self.weight.detach()), GatherRows.apply(self.bias)",
            "tensor 'weight.grad' at step 1: none; backward must reach the rank's rows"),
    },
    "tp_mlp": {
        "fc2's bias added on every rank": (
            ("F.linear(F.gelu(self.fc1(SumInBackward.apply(x))), self.fc2.weight)",
             "SumInForward.apply(partial) + self.fc2.bias"),
            ("self.fc2(F.gelu(self.fc1(SumInBackward.apply(x))))", "SumInForward.apply(partial)"),
            ("rank 0, output: largest difference", "fc2's bias was added 3 times")),
        "fc2's bias a third on each rank, before the sum": (
            "SumInForward.apply(partial) + self.fc2.bias",
            "SumInForward.apply(partial + self.fc2.bias / dist.get_world_size())",
            ("tensor 'fc2.bias.grad'", "the bias entered as 1/3 of it on each rank")),
        "a sum in backward after fc2 too": ("    def backward(ctx, grad):\n        return grad\n",
                                            "    def backward(ctx, grad):\n        grad = grad.clone()\n"
                                            "        dist.all_reduce(grad)\n        return grad\n",
                                            ("rank 0, tensor 'fc1.weight.grad'", "3.00×", "summed again")),
        "no sum of the input's gradient": ("self.fc1(SumInBackward.apply(x))", "self.fc1(x)",
                                           ("rank 0, tensor 'x.grad': largest difference", "each rank holds part")),
        "the hidden units cut in two": ("part = fc1.out_features // world", "part = fc1.out_features // 2",
                                        "rank 0, tensor 'fc1.weight' (this rank's shard): shape (7, 7), "
                                        "expected (5, 7)"),
        "gelu after the sum": (
            ("partial = F.linear(F.gelu(self.fc1(SumInBackward.apply(x))), self.fc2.weight)",
             "return SumInForward.apply(partial) + self.fc2.bias"),
            ("partial = F.linear(self.fc1(SumInBackward.apply(x)), self.fc2.weight)",
             "return F.gelu(SumInForward.apply(partial)) + self.fc2.bias"),
            "rank 0, output: largest difference"),
        "fc1's bias not cut with its rows": ("self.fc1.bias.copy_(fc1.bias[cut])", "self.fc1.bias.copy_(fc1.bias[:part])",
                                             "rank 1, tensor 'fc1.bias' (this rank's shard): largest difference"),
    },
    "LoRALinear": {
        "the base layer left trainable": ("        self.base.requires_grad_(False)\n", "",
                                          ("trainable parameters: 250, expected 96", "base.weight, base.bias")),
        "the base's bias left trainable": ("self.base.requires_grad_(False)", "self.base.weight.requires_grad_(False)",
                                           ("trainable parameters: 107, expected 96", "yours trains base.bias")),
        "A starts at zero": ("nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))", "nn.init.zeros_(self.A)",
                             "tensor 'B.grad' at the start: all zero"),
        "scaled by alpha, not alpha / r": ("alpha / r", "alpha",
                                           ("output with A and B set to peft's", "4× peft's", "yours by 6")),
        "alpha // r": ("alpha / r", "alpha // r", ("0.667× peft's", "alpha / r = 1.5, yours by 1")),
        "r / alpha": ("alpha / r", "r / alpha", ("0.444× peft's", "yours by 0.667")),
        "B starts random": ("torch.zeros(base.out_features, r)", "torch.randn(base.out_features, r)",
                            "output at the start: largest difference"),
        "the base layer's bias dropped": ("self.base(x) + ", "x @ self.base.weight.T + ",
                                          ("output at the start", "the base layer's bias is missing")),
        "A and B multiplied in the wrong order": ("self.A.T @ self.B.T", "self.A @ self.B",
                                                  "your code raised RuntimeError: mat1 and mat2"),
    },
    "ddp_from_hooks": {
        "no broadcast of the starting state": ("            dist.broadcast(p.data, src=0)\n", "            pass\n",
                                               ("rank 1, tensor 'fixed' after wrapping: largest difference", "frozen ones too")),
        "frozen parameters not broadcast": (
            "            dist.broadcast(p.data, src=0)\n",
            "            if p.requires_grad:\n                dist.broadcast(p.data, src=0)\n",
            ("rank 1, tensor 'fixed' after wrapping", "frozen ones too")),
        "no division by the number of ranks": ("        p.grad /= self.world\n", "",
                                               ("rank 0, tensor 'fc1.weight.grad' at step 1",
                                                "3.00× DDP's: summed over the 3 ranks, not averaged?")),
        "divided by 2": ("p.grad /= self.world", "p.grad /= 2",
                         "1.50× DDP's: divided by 2, not by the number of ranks (3)?"),
        "the average computed, never stored": (
            "        dist.all_reduce(p.grad)  # in place: the sum over the ranks\n        p.grad /= self.world\n",
            "        total = p.grad.clone()\n        dist.all_reduce(total)\n        total / self.world\n",
            ("tensor 'fc1.weight.grad' at step 1", "this rank's own gradient")),
        "hooks on frozen parameters too": ("            if p.requires_grad:  # a frozen parameter gets no gradient, "
                                           "so no hook\n", "            if True:\n",
                                           ("your code raised RuntimeError", "skip the parameters with "
                                                                             "requires_grad=False")),
        "the model itself returned": ("    return HookedDDP(model)", "    HookedDDP(model)\n    return model",
                                      ("ddp_from_hooks(model) returned the model itself", "`.module`")),
    },
}
# each exercise's mistakes whose refusal the test above cannot afford: each ends its launch (tested below)
HANGS = {
    "assistant_mask": ("the generation prompt rendered in the loop",
                       "tokenize=False)", "tokenize=False, add_generation_prompt=True)"),
    "ZeroOneAdamW": ("the owner alone calls broadcast", "            dist.broadcast(p.data, src=r)",
                     "            if r == dist.get_rank():\n                dist.broadcast(p.data, src=r)"),
}


def planted(name: str) -> dict:
    cells = {"reference": REFS[name].code, **ALTERNATIVES.get(name, {})}
    for bug, (old, new, _) in BUGS.get(name, {}).items():
        cells[bug] = plant(name, bug, old, new)
    return cells


def plant(name, bug, old, new) -> str:
    code = REFS[name].code
    for o, n in zip(*((old, new) if isinstance(old, tuple) else ((old,), (new,)))):  # one edit, or several
        assert o in code, f"{name}: the planted mistake {bug!r} no longer matches the reference"
        code = code.replace(o, n, 1)
    return code


@pytest.fixture(scope="module")
def verdicts():
    return builds.run({name: planted(name) for name in REFS}, timeout=400)


def test_every_build_exercise_has_a_check_a_reference_an_alternative_and_five_mistakes():
    assert set(REFS) == set(build_check.CHECKS) == set(ALTERNATIVES) == set(BUGS)
    assert all(len(BUGS[name]) >= 5 for name in REFS), {n: len(BUGS[n]) for n in REFS}


@pytest.mark.parametrize("name, label", [(n, label) for n in sorted(REFS)
                                         for label in ("reference", *ALTERNATIVES.get(n, {}))])
def test_the_reference_and_a_differently_written_answer_are_accepted(verdicts, name, label):
    assert verdicts[name][label] is None, verdicts[name][label]


@pytest.mark.parametrize("name, bug", [(n, b) for n in sorted(BUGS) for b in BUGS[n]])
def test_a_planted_mistake_is_refused_with_where_how_far_and_why(verdicts, name, bug):
    message = verdicts[name][bug]
    assert message is not None, f"{name}: {bug} was accepted"
    want = BUGS[name][bug][2]
    for fragment in (want if isinstance(want, tuple) else (want,)):
        assert fragment in message, message
    assert "Traceback" not in message and len(message.splitlines()) == 1


def test_a_cell_that_never_returns_or_keeps_allocating_ends_in_one_sentence():
    """The kernel's side of it: every check runs in processes of its own, each candidate bounded; a loop that never
    ends is interrupted, an allocation past the limit fails, a collective no other rank joins ends its launch, and
    each gets one sentence (this process, the kernel's stand-in, goes on)."""
    # 256 MiB a time, never touched: the limit is reached in a few allocations, however busy the machine (a
    # bytearray is zero-filled page by page: with the suite's other work beside it, 1 GB of it outlasted 4 s)
    hog = REFS["LoRALinear"].code.replace("        super().__init__()\n",
                                          "        super().__init__()\n        kept = []\n        while True:\n"
                                          "            kept.append(torch.empty(2 ** 26))\n", 1)
    cells = {name: {label: plant(name, label, old, new)} for name, (label, old, new) in HANGS.items()}
    cells["LoRALinear"] = {"a list that keeps growing": hog}
    said = builds.run(cells, limit_s=4, memory_gb=1)
    loop = said["assistant_mask"][HANGS["assistant_mask"][0]]
    assert loop.startswith("your assistant_mask never returned within 4 s: still running (line "), loop
    assert said["LoRALinear"]["a list that keeps growing"].startswith(
        "your LoRALinear ran out of its 1 GB (the check's limit) (line "), said["LoRALinear"]
    stuck = said["ZeroOneAdamW"][HANGS["ZeroOneAdamW"][0]]
    assert stuck.startswith("your ZeroOneAdamW never returned within 4 s: rank ") and "waited in " in stuck \
        and "for ranks that never joined it" in stuck, stuck
    assert all(len(m.splitlines()) == 1 for cells in said.values() for m in cells.values())


def test_a_cell_that_defines_nothing_or_does_not_compile_is_answered_in_one_line():
    assert build_check.verdict("LoRALinear", "x = 1\n") == "your cell defines no `LoRALinear`"
    assert build_check.verdict("LoRALinear", "def LoRALinear(:\n").startswith("your cell raised SyntaxError")


def test_in_a_notebook_the_learners_last_run_of_the_cell_is_checked(tmp_path, monkeypatch, capsys):
    """The learner's path: the check reads the cell from IPython's history (not the reference), the last run of it.
    (The check runs here in this process: the launch is what the tests above cover.)"""
    from IPython.core.interactiveshell import InteractiveShell

    from course_lib.workbook.results import Ledger

    monkeypatch.setattr(builds, "run", lambda candidates, **_: {
        name: {label: build_check.verdict(name, source) for label, source in cells.items()}
        for name, cells in candidates.items()})
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
    monkeypatch.setattr(build_check, "_TOKENIZER", [])
    cells = planted("assistant_mask")
    assert build_check.verdict("assistant_mask", cells["reference"]) is None
    assert "checked with the course's small ChatML tokenizer" in capsys.readouterr().out
    for bug in ("the end-of-turn token left out", "the role header trained"):
        message = build_check.verdict("assistant_mask", cells[bug])
        assert message is not None and "your mask" in message, (bug, message)
