"""The checks of the build-it-yourself exercises: the learner's code against the real thing.

    torchrun --nproc-per-node=3 build_check.py --candidates candidates.json    (`cl.builds.run` starts it)

`candidates.json` maps an exercise's name to {label: the source of a cell}. Every rank runs each cell on its own
(its own imports, none of the notebook's variables), hands what the cell defines to the exercise's check,
and reports (`cl.dist.report`, a JSON file per candidate and rank) nothing, or the first difference from the upstream
implementation it found (which rank, which tensor, how far off, and what that points at). A check raises `Differs`;
the learner's own exceptions are reported with the line of the cell they came from, never as a traceback.

Every check runs here, out of the notebook's kernel, and is bounded: a cell that runs longer than `--limit-s`
is stopped (interrupted where it loops in Python; its rank ended where it waits in a collective no other rank
joined) and a cell that allocates more than `--memory-gb` gets a MemoryError; either ends in one sentence. The
single-process checks (`CHECKS[name].ranks == 1`) run on rank 0 alone, before the distributed ones.
The distributed checks run on three ranks: with two, a divisor or an owner written as the number 2 would pass.

Each check's docstring lists the data chosen so that a learner's likely mistakes differ from the right answer;
tests/test_builds.py plants each of those mistakes and expects it refused.
"""
from __future__ import annotations

import _thread
import contextlib
import copy
import json
import math
import os
import resource
import sys
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import course_lib as cl

CHECKS: dict = {}
LIMIT_S = 30.0     # a candidate's check, one rank: the slowest right answer takes a few seconds on a loaded CPU
MEMORY_GB = 4.0    # what a candidate may allocate beyond what the check's process holds before it starts
RANKS = 3          # the distributed checks' world size (see the module docstring)


class Differs(Exception):
    """The learner's result is not the upstream one: the message says where and by how much."""


def check(ranks: int, prepare=None):
    """Register an exercise's check: a function of (what the learner's cell defines, this rank, world size).
    `prepare`: what it loads before the limits start (imports, a tokenizer), so they bound the learner's code."""
    def register(fn):
        fn.ranks, fn.prepare = ranks, prepare
        CHECKS[fn.__name__] = fn
        return fn
    return register


def proportion(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """r where `got` is r times `want` (to 1e-4 of want's size), else None."""
    g, w = got.detach().double().flatten(), want.detach().double().flatten()
    norm = float(w @ w)
    if not norm or not torch.isfinite(g).all():
        return None
    r = float(g @ w) / norm
    return r if float((g - r * w).norm()) <= 1e-4 * math.sqrt(norm) else None


def scaled_hint(r: float, world: int, of: str = "the reference's") -> str:
    """What a gradient r times the reference's points at, on `world` ranks."""
    if abs(r - world) < 1e-3 * world:
        return f"yours are {r:.2f}× {of}: summed over the {world} ranks, not averaged?"
    if world != 2 and abs(r - world / 2) < 1e-3 * world:
        return f"yours are {r:.2f}× {of}: divided by 2, not by the number of ranks ({world})?"
    if abs(r - 1 / world) < 1e-3:
        return f"yours are {r:.2f}× {of}: divided by the number of ranks twice?"
    if abs(r) < 1e-6:
        return f"yours are zero"
    return f"yours are {r:.3g}× {of}"


def close(what: str, got, want, atol: float = 1e-5, why: str = "", world: int | None = None,
          of: str = "the reference's") -> None:
    """Raise `Differs` unless tensor `got` equals `want` to `atol` (same shape first). Given `world`, where `got`
    is a multiple of `want` the message says which (`scaled_hint`) in place of `why`; where it holds inf or NaN,
    it says that."""
    if not isinstance(got, torch.Tensor):
        raise Differs(f"{what}: got {type(got).__name__}, expected a tensor of shape {tuple(want.shape)}")
    if tuple(got.shape) != tuple(want.shape):
        raise Differs(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}" + (f"; {why}" if why else ""))
    diff = (got.detach().double() - want.detach().double()).abs().max().item() if want.numel() else 0.0
    if diff <= atol:  # (a NaN fails)
        return
    bad = int((~torch.isfinite(got.detach())).sum())
    if bad:
        raise Differs(f"{what}: {bad} of {got.numel()} values are inf or NaN" + (f"; {why}" if why else ""))
    r = proportion(got, want) if world else None
    hint = scaled_hint(r, world, of) if r is not None else why
    raise Differs(f"{what}: largest difference {diff:.3g} (tolerance {atol:g})" + (f"; {hint}" if hint else ""))


END = "end of the check"  # what a rank that left its check sends to the comparisons of the others (`together`)


def _gather(payload, world: int) -> list:
    got = [None] * world
    torch.distributed.all_gather_object(got, payload)
    return got


def _ended(payload) -> bool:
    return isinstance(payload, tuple) and len(payload) == 2 and payload[0] == END


@contextlib.contextmanager
def together(rank: int, world: int):
    """Comparisons every rank makes at the same point: if one rank finds a difference, every rank stops there
    (with that rank's message), so none is left waiting in a collective of the learner's code. A rank whose check
    ended early (the learner's code raised there alone) is met here by its end (`finish`): the others stop with
    its message."""
    message = None
    try:
        yield
    except Differs as d:
        message = str(d)
    except Exception as e:  # the learner's code, raising on some ranks only: the others must not wait for them
        message = f"your code raised {_where(e)}"
    if world > 1:
        messages = _gather(message, world)
        first = next(((r, m[1] if _ended(m) else m) for r, m in enumerate(messages)
                      if (m[1] if _ended(m) else m) is not None or _ended(m)), None)
        if first:
            said = first[1] or "its check ended here while this rank's went on: the ranks made different calls"
            raise Differs(said if said.startswith("rank ") else f"rank {first[0]}, {said}")
    elif message:
        raise Differs(message)


def finish(message, world: int) -> None:
    """The end of a candidate on every rank, whatever its outcome: ranks still comparing (`together`) are answered
    with this rank's message, until every rank has ended, so the next candidate starts with every rank in step."""
    if world > 1:
        while not all(_ended(m) for m in _gather((END, message), world)):
            pass


def equal(what: str, got, want, why: str = "") -> None:
    if got != want:
        raise Differs(f"{what}: {got!r}, expected {want!r}" + (f"; {why}" if why else ""))


# --- 01: fp16 loss scaling against GradScaler ---------------------------------------------------------------
def _poison(value: float):
    """A hook on the output's gradient that puts `value` (inf or NaN) into it: the loss stays finite."""
    def hook(grad):
        grad = grad.clone()
        grad[0, 0] = value
        return grad
    return hook


@check(ranks=1)
def LossScaler(make, rank=0, world=1):
    """`LossScaler(init_scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)` with `scale(loss)`,
    `step(optimizer)`, `update()` and `get_scale()`: 12 steps compared with `torch.amp.GradScaler` on the scale and
    the weights after every step. The data that tells the mistakes apart: factors 4 and 0.25 and an interval of 3
    (not the defaults); an inf in the gradients (the loss finite) at step 5, one clean step after a growth, and a
    NaN at step 12; growths at steps 3, 8 and 11 (two in a row); SGD with momentum and weight decay, so a step
    taken on zeroed gradients still moves the weights."""
    torch.manual_seed(0)
    models = [nn.Linear(6, 3) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01) for m in models]
    factors = dict(init_scale=2.0 ** 10, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    mine = make(**factors)
    theirs = torch.amp.GradScaler("cpu", **factors)
    bad = {5: float("inf"), 12: float("nan")}
    for step in range(1, 13):
        x = torch.randn(4, 6)
        before = theirs.get_scale()
        for model, opt, scaler in zip(models, opts, (mine, theirs)):
            opt.zero_grad()
            out = model(x)
            if step in bad:
                out.register_hook(_poison(bad[step]))
            scaler.scale(out.square().mean()).backward()
            scaler.step(opt)
            scaler.update()
        got = mine.get_scale()
        got, want = float(got.item() if isinstance(got, torch.Tensor) else got), theirs.get_scale()
        if got != want:
            ratio = got / want if want else float("nan")
            if step in bad:
                why = (f"the gradients held {'an inf' if bad[step] > 0 else 'a NaN'} (the loss itself was finite): "
                       "look at every gradient after backward, with torch.isfinite, which sees NaN too")
            elif ratio == 1 / factors["growth_factor"]:
                why = ("GradScaler grew it here, after growth_interval clean steps in a row counted from the last "
                       "change (a growth or a backoff); yours did not")
            elif ratio == factors["growth_factor"]:
                why = ("yours grew here and GradScaler did not: the count of clean steps starts again after an "
                       "overflow and after each growth")
            elif ratio in (0.5, 2.0):
                why = "use the factors passed to __init__ (4 and 0.25 here), not the defaults"
            else:
                why = (f"yours is {ratio:.3g}× GradScaler's: multiply by backoff_factor after an overflow, by "
                       "growth_factor after growth_interval clean steps in a row")
            raise Differs(f"scale after step {step}: {got:g}, expected {want:g}; {why}")
        for name in ("weight", "bias"):
            a, b = getattr(models[0], name), getattr(models[1], name)
            if step in bad:
                why = ("skip optimizer.step() when any gradient is inf or NaN" if not torch.isfinite(a).all() else
                       "skip the step at an overflow: a step on zeroed gradients still moves the weights (momentum, "
                       "weight decay)")
            else:
                g, g_want = a.grad, b.grad
                r = proportion(g, g_want) if isinstance(g, torch.Tensor) and g.shape == g_want.shape else None
                if r is not None and abs(r - before) < 1e-3 * before:
                    why = (f"the gradients were still multiplied by the scale ({r:.4g}× GradScaler's): divide each "
                           "by the scale before the optimizer's step")
                elif r is not None and abs(r * before - 1) < 1e-3:
                    why = "the gradients were divided by the scale twice"
                else:
                    why = "unscale the gradients before the step, and skip the step when any is inf or NaN"
            close(f"tensor '{name}' after step {step}", a, b, atol=1e-6, why=why)


# --- 03: a checkpointed block against torch.utils.checkpoint ----------------------------------------------------
@check(ranks=1)
def checkpointed(run, rank=0, world=1):
    """`checkpointed(block, x)`: block(x) through a custom autograd Function that keeps only its input in forward
    and runs the block again in backward; compared with `torch.utils.checkpoint` (use_reentrant=True) on the
    output, the gradients of the input and of every weight, twice: the input a leaf that requires grad, then the
    output of an earlier layer (whose weights get their gradient through the block); then the bytes autograd saves,
    counted in a third forward of its own (the counting hooks would hand backward a copy of the input)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    first = nn.Linear(24, 40)
    block = nn.Sequential(nn.Linear(40, 72), nn.GELU(), nn.Linear(72, 40))
    x, leaf = torch.randn(9, 24), torch.randn(9, 40)
    named = [("block." + n, p) for n, p in block.named_parameters()]
    for case in ("a leaf", "an earlier layer's output"):
        results = {}
        for who, fn in (("yours", run), ("torch", lambda b, t: checkpoint(b, t, use_reentrant=True))):
            block.zero_grad()
            first.zero_grad()
            inp = (leaf if case == "a leaf" else x).clone().requires_grad_(True)
            out = fn(block, inp if case == "a leaf" else first(inp))
            if not isinstance(out, torch.Tensor):
                raise Differs(f"output: got {type(out).__name__}, expected a tensor")
            out.square().sum().backward()
            params = named + ([("first." + n, p) for n, p in first.named_parameters()] if case != "a leaf" else [])
            results[who] = (out.detach(), inp.grad, [(n, p.grad.clone() if p.grad is not None else None)
                                                     for n, p in params])
        (out, xg, grads), (out_t, xg_t, grads_t) = results["yours"], results["torch"]
        close(f"output (the input {case})", out, out_t)
        if xg is None:
            raise Differs(f"tensor 'x.grad' (the input {case}): none; backward must return the input's gradient")
        r = proportion(xg, xg_t)
        close(f"tensor 'x.grad' (the input {case})", xg, xg_t,
              why=("backward ran the block on the saved input itself, so its gradient reached x twice: "
                   "recompute from x.detach().requires_grad_()" if r is not None and abs(r - 2) < 1e-3 else ""))
        for (name, g), (_, g_t) in zip(grads, grads_t):
            if g is None:
                raise Differs(f"tensor '{name}.grad' (the input {case}): none; the recomputation in backward must "
                              "reach the block's weights (torch.autograd.backward, not torch.autograd.grad)")
            close(f"tensor '{name}.grad' (the input {case})", g, g_t)
    saved_bytes = {}
    for who, fn in (("yours", run), ("torch", lambda b, t: checkpoint(b, t, use_reentrant=True))):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            fn(block, leaf.clone().requires_grad_(True))
        saved_bytes[who] = sum(saved)
    if saved_bytes["yours"] == 0:
        raise Differs("bytes saved for backward: 0; keep the input with ctx.save_for_backward, where autograd "
                      "accounts for what backward needs (an attribute of ctx escapes it)")
    equal("bytes saved for backward", saved_bytes["yours"], saved_bytes["torch"],
          "forward keeps only the input (a Function's forward records no graph), as torch.utils.checkpoint does"
          + (": yours keeps twice that, the output too?" if saved_bytes["yours"] == 2 * saved_bytes["torch"] else ""))


# --- 06: a ZeRO-1 optimizer against AdamW ------------------------------------------------------------------------
def state_bytes(obj, skip: set, depth: int = 4) -> int:
    """Bytes of the tensors an optimizer object holds (its optimizers' state, tensors in its attributes), the
    model's parameters and gradients (`skip`, by id) left out."""
    if depth < 0:
        return 0
    if isinstance(obj, torch.Tensor):
        return 0 if id(obj) in skip else obj.numel() * obj.element_size()
    if isinstance(obj, torch.optim.Optimizer):  # its state, and whatever else it holds (an inner optimizer)
        rest = {k: v for k, v in vars(obj).items() if k not in ("state", "param_groups", "defaults")}
        return (sum(state_bytes(v, skip, depth - 1) for v in obj.state.values())
                + sum(state_bytes(v, skip, depth - 1) for v in rest.values()))
    if isinstance(obj, dict):
        return sum(state_bytes(v, skip, depth - 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v, skip, depth - 1) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
        return sum(state_bytes(v, skip, depth - 1) for v in vars(obj).values())
    return 0


def _one_step(before, grads, make, **kwargs):
    """The parameters after one step of a fresh optimizer `make(params, **kwargs)` from `before` with `grads`."""
    params = [nn.Parameter(b.clone()) for b in before]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    make(params, **kwargs).step()
    return [p.detach() for p in params]


@check(ranks=RANKS)
def ZeroOneAdamW(make, rank, world):
    """`ZeroOneAdamW(params, lr, weight_decay)` with `step()`: each rank keeps AdamW's state for its own share of
    the parameters only, updates that share, and hands the updated values to the other ranks. The gradients arrive
    averaged over the ranks (as after DDP's all-reduce); 5 steps compared with one AdamW over every parameter, then
    the state's bytes on every rank. The data that tells the mistakes apart: three ranks and 148 parameters (an
    even split would leave some out), weight decay 0.05 (AdamW's default is 0.01), gradients of about 1e-7, where
    AdamW's eps makes the update depend on the gradient's scale, and the gradients compared after `step()` too."""
    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 5))
    reference = copy.deepcopy(model)
    lr, decay = 0.02, 0.05
    with together(rank, world):
        mine = make(model.parameters(), lr=lr, weight_decay=decay)
    full = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=decay)
    names = [n for n, _ in model.named_parameters()]
    for step in range(1, 6):
        data = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(5, 7, generator=data), torch.randn(5, 5, generator=data)
        before = [p.detach().clone() for p in model.parameters()]
        for m, opt in ((model, mine), (reference, full)):
            for p in m.parameters():
                p.grad = None
            (F.mse_loss(m(x), y) * 1e-7).backward()
            for p in m.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
            if m is model:
                handed = [p.grad.clone() for p in m.parameters()]
            opt.step()
        with together(rank, world):
            for name, p, h in zip(names, model.parameters(), handed):
                if p.grad is not None and not torch.equal(p.grad, h):
                    r = proportion(p.grad, h)
                    raise Differs(f"tensor '{name}.grad' after step {step}: your step() changed the gradients it was "
                                  "handed" + (f" ({r:.2f}× what they were: an all-reduce of gradients that arrive "
                                              "already averaged?)" if r is not None and abs(r - 1) > 1e-3 else ""))
            for i, (name, a, b) in enumerate(zip(names, model.parameters(), reference.parameters())):
                if (a - b).abs().max() <= 1e-6:
                    continue
                stale = int(((a == before[i]) & (b != before[i])).sum())
                why = (f"{stale} of {a.numel()} values of this rank's copy did not change at this step: every rank "
                       "must end a step with every parameter updated, sent by the rank that owns it" if stale else
                       "every rank must end a step with every parameter updated (by the rank that owns it)")
                if step == 1 and not stale:  # which optimizer did the step take? (from a fresh state, as at step 1)
                    for label, other, kw in (
                            ("AdamW with weight_decay=0.01, its default: pass weight_decay on", torch.optim.AdamW,
                             dict(lr=lr, weight_decay=0.01)),
                            ("AdamW without weight decay: pass weight_decay on", torch.optim.AdamW,
                             dict(lr=lr, weight_decay=0.0)),
                            ("Adam, whose weight decay is an L2 term in the gradient: AdamW decays the weights "
                             "apart from it", torch.optim.Adam, dict(lr=lr, weight_decay=decay)),
                            ("AdamW on gradients twice as large: are they summed again?", None, None)):
                        grads = handed if other else [2 * h for h in handed]
                        alt = _one_step(before, grads, other or torch.optim.AdamW, **(kw or dict(lr=lr, weight_decay=decay)))
                        if all((p.detach() - q).abs().max() <= 1e-6 for p, q in zip(model.parameters(), alt)):
                            why = f"yours took the step of {label}"
                            break
                close(f"tensor '{name}' after step {step}", a, b, atol=1e-6, why=why)
    skip = {id(t) for p in model.parameters() for t in (p, p.grad) if t is not None}
    held = [None] * world
    torch.distributed.all_gather_object(held, state_bytes(mine, skip))
    want = state_bytes(full, {id(t) for p in reference.parameters() for t in (p, p.grad) if t is not None})
    said = f"rank 0 holds {held[0]:,} bytes of optimizer state, " + ", ".join(
        f"rank {r} {b:,}" for r, b in enumerate(held) if r) + f"; AdamW over every parameter holds {want:,}"
    # sharded: no rank holds AdamW's whole state, every rank some of it, and together at most 1.5 times it (a flat
    # partition may keep an fp32 copy of its shard beside the two moments: 12 bytes a parameter against 8), and
    # 16 bytes a rank besides (its own step count, and its shard padded by a value or two)
    if max(held) >= want or sum(held) > 1.5 * want + 16 * world:
        raise Differs(f"{said} (the largest {max(held) / want:.2f}× it, together {sum(held) / want:.2f}×, at most 1.5×): "
                      "each rank keeps the state of its own share only; every parameter's moments on a rank, or a "
                      "full-size buffer kept between steps (a gather's output, a flat copy of every parameter)?")
    if min(held) == 0:
        idle = [r for r, b in enumerate(held) if b == 0]
        raise Differs(f"{said}: rank {idle[0]} owns nothing; with {world} ranks every rank keeps a share "
                      "(the shares computed for another number of ranks?)")


# --- 07: FSDP's core, a layer gathered for forward and reduce-scattered in backward -----------------------------
@check(ranks=RANKS)
def ShardedLinear(make, rank, world):
    """`ShardedLinear(linear)`: parameters `weight` and `bias` holding this rank's rows only (rank r: rows
    r·out/world to (r+1)·out/world); forward gathers the whole weight and bias from every rank, backward hands each
    rank the gradient of its own rows, averaged over the ranks. Compared with `fully_shard` on the outputs, the
    gradients and the numbers each rank holds, over 3 steps, on three ranks (a 7 → 9 layer: 3 rows each), each rank
    its own batch."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    linear = nn.Linear(7, 9)
    with together(rank, world):
        mine = make(copy.deepcopy(linear))
    theirs = fully_shard(copy.deepcopy(linear))
    rows = linear.out_features // world
    with together(rank, world):
        for name in ("weight", "bias"):
            got, want = getattr(mine, name, None), getattr(theirs, name).to_local()
            if not isinstance(got, torch.Tensor):
                raise Differs(f"tensor '{name}': the layer has no parameter named {name} (this rank's rows)")
            why = f"rank r keeps rows r·{linear.out_features}/{world} up to (r+1)·{linear.out_features}/{world}"
            if got.shape == want.shape:
                whole = getattr(linear, name).detach()
                owner = next((r for r in range(world) if torch.equal(got, whole[r * rows:(r + 1) * rows])), None)
                if owner is not None and owner != rank:
                    why = f"yours holds rank {owner}'s rows; " + why
            elif name == "bias":
                why = "the bias is cut like the weight's rows; " + why
            close(f"tensor '{name}' (this rank's rows)", got, want, atol=0.0, why=why)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (mine, theirs)]
    local = copy.deepcopy(linear)
    for step in range(1, 4):
        x = torch.randn(5, 7, generator=torch.Generator().manual_seed(10 * step + rank))
        outs = []
        for m, opt in zip((mine, theirs), opts):
            opt.zero_grad()
            out = m(x)
            out.square().sum().backward()
            outs.append(out)
        with torch.no_grad():  # this rank's own gradient, for the hint: the full layer as it is now, on this batch
            for p, q in zip(local.parameters(), theirs.parameters()):
                p.copy_(q.full_tensor())
        local.zero_grad()
        local(x).square().sum().backward()
        with together(rank, world):
            close(f"output at step {step}", outs[0], outs[1])
            for name in ("weight", "bias"):
                g = getattr(mine, name).grad
                if g is None:
                    raise Differs(f"tensor '{name}.grad' at step {step}: none; backward must reach the rank's rows "
                                  "(gather inside a torch.autograd.Function whose backward reduce-scatters)")
                own = getattr(local, name).grad[rank * rows:(rank + 1) * rows]
                why = ("each rank's rows get the gradient summed over the ranks, divided by their number"
                       if not (g.shape == own.shape and torch.allclose(g, own, atol=1e-5)) else
                       "yours is this rank's own gradient: the rows' gradient is summed over the ranks "
                       "(reduce-scatter), then divided by their number")
                close(f"tensor '{name}.grad' at step {step}", g, getattr(theirs, name).grad.to_local(), why=why,
                      world=world, of="fully_shard's")
        for opt in opts:
            opt.step()


# --- 08: tensor parallelism, a column- then a row-parallel linear -------------------------------------------------
@check(ranks=RANKS)
def tp_mlp(make, rank, world):
    """`tp_mlp(fc1, fc2)` -> a module computing fc2(gelu(fc1(x))) on every rank with attributes `fc1` (nn.Linear
    holding this rank's output rows of fc1 and their bias) and `fc2` (nn.Linear holding this rank's input columns of
    fc2, and its whole bias). Compared with the unsharded MLP on the output, the input's gradient and the gradients
    of both weights and both biases, on three ranks (a 7 → 15 → 6 MLP: 5 hidden units each)."""
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(7, 15), nn.Linear(15, 6)
    with together(rank, world):
        module = make(copy.deepcopy(fc1), copy.deepcopy(fc2))
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(3))  # the same input on every rank
    mine_x, ref_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    rows = slice(rank * 15 // world, (rank + 1) * 15 // world)
    parts = (("fc1.weight", fc1.weight[rows]), ("fc1.bias", fc1.bias[rows]), ("fc2.weight", fc2.weight[:, rows]),
             ("fc2.bias", fc2.bias))

    def mine_of(name):
        return getattr(getattr(module, name.split(".")[0], None), name.split(".")[1], None)

    with together(rank, world):
        for name, want in parts:
            got = mine_of(name)
            if got is None:
                raise Differs(f"tensor '{name}': the module has no {name.split('.')[0]} linear with a {name.split('.')[1]}")
            close(f"tensor '{name}' (this rank's shard)", got, want, atol=0.0,
                  why="fc1 splits its output rows (and their bias), fc2 its input columns (its bias whole), rank r "
                      "the r-th part")
    out = module(mine_x)
    want = fc2(F.gelu(fc1(ref_x)))
    with together(rank, world):
        extra = proportion(out - want, fc2.bias.detach().expand_as(want)) if isinstance(out, torch.Tensor) and \
            out.shape == want.shape else None
        close("output", out, want, why=(f"fc2's bias was added {extra + 1:.0f} times: add it once, after the sum"
                                        if extra is not None and abs(extra - round(extra)) < 1e-3 and extra > 0.5 else
                                        "the partial outputs summed over the ranks, fc2's bias added once"))
    out.square().sum().backward()
    want.square().sum().backward()
    summed_again = {world: "the gradient was summed again on its way back through the sum after fc2 (it passes "
                           "unchanged: every rank already holds the whole output's gradient)"}
    with together(rank, world):
        for name, ref in (("fc1.weight", fc1.weight.grad[rows]), ("fc1.bias", fc1.bias.grad[rows]),
                          ("fc2.weight", fc2.weight.grad[:, rows]), ("fc2.bias", fc2.bias.grad)):
            got = mine_of(name).grad
            if got is None:
                raise Differs(f"tensor '{name}.grad': none; backward must reach this rank's shard")
            r = proportion(got, ref) if got.shape == ref.shape else None
            why = ""
            if r is not None and abs(r - world) < 1e-3 * world:
                why = f"yours are {r:.2f}× the unsharded MLP's: " + summed_again[world]
            elif r is not None and abs(r * world - 1) < 1e-3 and name == "fc2.bias":
                why = (f"yours is {r:.2f}× the unsharded MLP's: the bias entered as 1/{world} of it on each rank, "
                       "before the sum; add it whole, once, after")
            close(f"tensor '{name}.grad'", got, ref, why=why or "compare what each rank holds whole and in part, "
                                                               "forward and backward")
        if mine_x.grad is None:
            raise Differs("tensor 'x.grad': none")
        r = proportion(mine_x.grad, ref_x.grad)
        close("tensor 'x.grad'", mine_x.grad, ref_x.grad,
              why=(f"yours are {r:.2f}× the unsharded MLP's: " + summed_again[world]) if r is not None and
              abs(r - world) < 1e-3 * world else "each rank holds part of the input's gradient: backward sums them "
              "over the ranks, where forward did nothing")


# --- 09: a LoRA linear against peft's -------------------------------------------------------------------------
def _import_peft():
    import peft  # noqa: F401  (seconds, the first time: before the check's clock starts)


@check(ranks=1, prepare=_import_peft)
def LoRALinear(make, rank=0, world=1):
    """`LoRALinear(base, r, alpha)`: base(x) + (alpha / r) * x Aᵀ Bᵀ, with A (r x in) and B (out x r) the only
    trainable parameters and B zero at the start; compared with peft's `LoraConfig(r=4, lora_alpha=6)` on a 13 → 11
    linear (alpha / r = 1.5: neither an integer nor alpha nor r / alpha): the trainable count, the output at the
    start, then with A and B set to peft's the output and the gradients of A, B and the input."""
    from peft import LoraConfig, inject_adapter_in_model

    r, alpha = 4, 6.0
    torch.manual_seed(0)
    base = nn.Linear(13, 11)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=["lin"])
    theirs = inject_adapter_in_model(config, nn.Sequential(OrderedDict(lin=copy.deepcopy(base)))).lin
    mine = make(copy.deepcopy(base), r, alpha)
    trainable = {n: p.numel() for n, p in mine.named_parameters() if p.requires_grad}
    want = sum(p.numel() for p in theirs.parameters() if p.requires_grad)
    frozen_too = [n for n in trainable if n not in ("A", "B")]
    equal("trainable parameters", sum(trainable.values()), want,
          "peft trains A and B only: the base layer's weight and bias stay frozen (requires_grad=False)"
          + (f"; yours trains {', '.join(frozen_too)}" if frozen_too else ""))
    for name, shape in (("A", (r, 13)), ("B", (11, r))):
        got = getattr(mine, name, None)
        if not isinstance(got, torch.Tensor):
            raise Differs(f"tensor '{name}': the layer has no parameter named {name} (shape {shape})")
        equal(f"tensor '{name}' shape", tuple(got.shape), shape)
    x = torch.randn(5, 13)
    start = mine(x)
    missing_bias = proportion(start - base(x), base.bias.detach().expand_as(start)) if start.shape == (5, 11) else None
    close("output at the start", start, base(x),
          why="the base layer's bias is missing: call the base layer whole" if missing_bias is not None and
          abs(missing_bias + 1) < 1e-3 else "B starts at zero, so the adapted layer starts as the base")
    mine(x).square().sum().backward()
    if mine.B.grad is None or not mine.B.grad.abs().sum() > 0:
        raise Differs("tensor 'B.grad' at the start: all zero, so B would never move; A starts random (peft: Kaiming "
                      "uniform), only B at zero")
    mine.zero_grad()
    with torch.no_grad():  # the same adapter weights in both, B no longer zero
        theirs.lora_B["default"].weight.normal_()
        mine.A.copy_(theirs.lora_A["default"].weight)
        mine.B.copy_(theirs.lora_B["default"].weight)
    x_mine, x_theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, out_t = mine(x_mine), theirs(x_theirs)
    scale = proportion(out - base(x), out_t - base(x))
    close("output with A and B set to peft's", out, out_t,
          why=f"the adapter's part is {scale:.3g}× peft's: it is scaled by alpha / r = {alpha / r:g}"
          + (f", yours by {scale * alpha / r:.3g}" if scale is not None else "") if scale is not None else "")
    out.square().sum().backward()
    out_t.square().sum().backward()
    close("tensor 'A.grad'", mine.A.grad, theirs.lora_A["default"].weight.grad, atol=1e-4)
    close("tensor 'B.grad'", mine.B.grad, theirs.lora_B["default"].weight.grad, atol=1e-4)
    close("tensor 'x.grad'", x_mine.grad, x_theirs.grad, atol=1e-4, why="the input's gradient flows through the base "
                                                                         "layer and the adapter both")


# --- 05: DDP from gradient hooks against DistributedDataParallel -----------------------------------------------
class _Toy(nn.Module):
    """The model a DDP test suite uses: a frozen bias inside forward, a frozen parameter forward never uses."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(7, 13), nn.Linear(13, 5)
        self.fc2.bias.requires_grad_(False)
        self.fixed = nn.Parameter(torch.randn(3), requires_grad=False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


@check(ranks=RANKS)
def ddp_from_hooks(wrap, rank, world):
    """`ddp_from_hooks(model)` -> a module wrapping `model` (reachable as `.module`, as DistributedDataParallel's):
    every rank starts from rank 0's parameters, frozen ones too, and each trainable parameter's gradient is averaged
    over the ranks during backward (frozen ones, requires_grad=False, get no hook and no gradient). 5 SGD steps on
    each rank's own batches compared with `DistributedDataParallel` on three ranks (a divisor written as 2 shows)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(100 + rank)  # ranks initialised differently: wrapping must line them up
    model = _Toy()
    reference = DDP(copy.deepcopy(model))  # DDP broadcasts rank 0's state when it wraps
    with together(rank, world):
        wrapped = wrap(model)
    names = [n for n, _ in reference.module.named_parameters()]
    with together(rank, world):
        for name, mine, want in zip(names, model.parameters(), reference.module.parameters()):
            close(f"tensor '{name}' after wrapping", mine, want, atol=0.0,
                  why="every rank must start from rank 0's parameters (DDP broadcasts them all"
                      + (", frozen ones too)" if not mine.requires_grad else ")"))
        if wrapped is None or wrapped is model or getattr(wrapped, "module", None) is not model:
            got = ("the model itself" if wrapped is model else "None" if wrapped is None else
                   f"a {type(wrapped).__name__} without the model as its `.module`")
            raise Differs(f"ddp_from_hooks(model) returned {got}; return a module that wraps the model, with the "
                          "model as its `.module` and forward calling it, as DistributedDataParallel does (a DDP "
                          "test reaches the model there)")
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in (model, reference)]
    local = _Toy()
    for step in range(1, 6):
        data = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
        x, y = torch.randn(5, 7, generator=data), torch.randn(5, 5, generator=data)
        local.load_state_dict(model.state_dict())
        F.mse_loss(local(x), y).backward()  # this rank's own gradient, for the hint
        for m, opt in zip((wrapped, reference), opts):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
        with together(rank, world):
            for (name, mine), want, own in zip(model.named_parameters(), reference.module.parameters(),
                                               local.parameters()):
                if not mine.requires_grad:
                    if mine.grad is not None:
                        raise Differs(f"tensor '{name}.grad' at step {step}: a frozen parameter got a gradient")
                    continue
                if mine.grad is None:
                    raise Differs(f"tensor '{name}.grad' at step {step}: none (did backward reach the model?)")
                why = ("yours is this rank's own gradient: the average never reached p.grad (a post-accumulate "
                       "hook's return value is ignored: assign p.grad)" if torch.allclose(mine.grad, own.grad,
                                                                                          atol=1e-7) else
                       "DDP's gradient is the mean over the ranks")
                close(f"tensor '{name}.grad' at step {step}", mine.grad, want.grad, why=why, world=world,
                      of="DDP's")
        for opt in opts:
            opt.step()
        local.zero_grad()
    with together(rank, world):
        for name, mine, want in zip(names, model.parameters(), reference.module.parameters()):
            close(f"tensor '{name}' after 5 steps", mine, want)


# --- 10: the assistant-only loss mask under Qwen's template -----------------------------------------------------
CHATS = [
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "What does gradient accumulation change?"},
     {"role": "assistant", "content": "The batch per optimizer step, not the memory per micro-batch."},
     {"role": "user", "content": "And the learning rate?"},
     {"role": "assistant", "content": "Keep the one tuned for that effective batch."}],
    [{"role": "user", "content": "Reverse 4812"}, {"role": "assistant", "content": "2184"}],
    [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"},
     {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "11"},
     {"role": "user", "content": "And one more."}, {"role": "assistant", "content": "13, the last."}],
]
_TOKENIZER: list = []  # (tokenizer, note), loaded once per process


def _mask_tokenizer():
    if not _TOKENIZER:
        from transformers import AutoTokenizer

        try:
            _TOKENIZER.append((AutoTokenizer.from_pretrained(cl.tokenizer.fetch_qwen_tokenizer(), local_files_only=True),
                               ""))
        except (RuntimeError, OSError) as e:
            _TOKENIZER.append((cl.tokenizer.train_tokenizer([m["content"] for chat in CHATS for m in chat]),
                               f"(checked with the course's small ChatML tokenizer: Qwen's is not on this machine: {e})"))
    return _TOKENIZER[0]


def _runs(mask: list) -> list:
    """(start, stop) of each run of ones in `mask`."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


@check(ranks=1, prepare=_mask_tokenizer)
def assistant_mask(make, rank=0, world=1):
    """`assistant_mask(tokenizer, messages)` -> (ids, mask): the ids of the conversation as the chat template
    renders it, and 1 on every token the assistant says, its end-of-turn token included; compared token by token
    with the course's `cl.data.assistant_mask` under Qwen's own tokenizer, on three conversations (a system prompt,
    several assistant turns, one without a system prompt). Where Qwen's tokenizer cannot be had (no npm, no cached
    copy), under the course's own small ChatML tokenizer, said in a line."""
    tokenizer, note = _mask_tokenizer()
    if note:
        print(note)
    for n, chat in enumerate(CHATS, 1):
        ids, mask = cl.data.assistant_mask(tokenizer, chat)
        answer = make(tokenizer, chat)
        if not (isinstance(answer, (tuple, list)) and len(answer) == 2):
            raise Differs(f"conversation {n}: return (ids, mask), two lists of ints; got {type(answer).__name__}")
        if hasattr(answer[0], "keys"):
            raise Differs(f"conversation {n}: your ids are a dict (apply_chat_template returns one when it "
                          "tokenizes): return its 'input_ids'")
        got_ids, got_mask = (list(map(int, v)) for v in answer)
        if got_ids != ids:
            i = next((i for i, (a, b) in enumerate(zip(got_ids, ids)) if a != b), min(len(ids), len(got_ids)))
            raise Differs(f"conversation {n}: token ids differ first at position {i} (yours {len(got_ids)} tokens, "
                          f"the template's {len(ids)}): the ids are the rendered conversation, tokenized"
                          + (": without the generation prompt" if len(got_ids) > len(ids) and got_ids[:len(ids)] == ids
                             else ""))
        wrong = [i for i, (a, b) in enumerate(zip(got_mask, mask)) if a != b]
        equal(f"conversation {n}: mask length", len(got_mask), len(mask))
        if wrong:
            i = wrong[0]
            words = {tokenizer.decode([ids[j]]) for j in wrong}
            why, missed = "", all(got_mask[j] == 0 for j in wrong)
            turns = _runs(mask)  # (start, stop) of each assistant turn's tokens
            whole = [k for k, (a, b) in enumerate(turns, 1) if all(got_mask[j] == 0 for j in range(a, b))]
            if words == {"\n"}:
                why = ": the newline after <|im_end|> belongs to no turn"
            elif missed and words == {"<|im_end|>"}:
                why = ": each turn's <|im_end|> is the assistant's too (it learns to stop)"
            elif missed and "<think>" in words:
                why = ": the empty <think></think> block the template opens the last answer with is part of the turn"
            elif missed and whole:
                why = f": your mask misses assistant turn {whole[0]} of {len(turns)}; every assistant turn is trained"
            elif not missed and words <= {"<|im_start|>", "assistant", "\n"}:
                why = ": the header <|im_start|>assistant is the template's, not the answer"
            raise Differs(f"conversation {n}, token {i} ({tokenizer.decode([ids[i]])!r}): your mask {got_mask[i]}, "
                          f"expected {mask[i]} ({len(wrong)} of {len(mask)} tokens differ){why}")


# --- running a cell, bounded ------------------------------------------------------------------------------------
HINTS = (  # (a fragment of an exception's text, the exercises it means this in (None: all), what it usually means)
    ("does not require grad and does not have a grad_fn", ("checkpointed",),
     "backward runs with gradients off: recompute the block under torch.enable_grad()"),
    ("doesn't require gradient", None, "skip the parameters with requires_grad=False: a frozen one gets no gradient"),
    ("invalid root rank", None, "a rank that does not exist here: compute the owners from dist.get_world_size()"),
    ("empty parameter list", ("ZeroOneAdamW",), "this rank owns nothing: share the parameters among all "
                                               "dist.get_world_size() ranks"),
    ("Default process group has not been initialized", None,
     "the check's process group exists already: do not create or destroy one"),
)


class Limits:
    """Bounds the candidate being checked: `limit_s` seconds and `memory_gb` beyond what the process holds when
    the limits start (RLIMIT_AS: past it an allocation fails with a MemoryError). Where a cell still runs at its
    deadline, a thread interrupts it (KeyboardInterrupt, in Python code); where it does not return within a few
    seconds more (it waits in a collective no other rank joined, or in C), the thread reports the cell and ends
    the process: the launcher's other ranks end with it, and `cl.builds.run` starts the remaining candidates again."""

    GRACE_S = 3.0

    def __init__(self, limit_s: float, memory_gb: float, rank: int):
        self.limit_s, self.memory_gb, self.rank = limit_s, memory_gb, rank
        self.current, self.deadline, self.fired = None, None, False
        self.main = threading.main_thread().ident
        if memory_gb > 0:
            held = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            want = held + int(memory_gb * 2 ** 30)
            resource.setrlimit(resource.RLIMIT_AS, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
        threading.Thread(target=self._watch, daemon=True, name="build-check-limits").start()

    @contextlib.contextmanager
    def bound(self, name: str, label: str, distributed: bool):
        self.current, self.fired = (name, label, distributed), False
        self.deadline = time.monotonic() + self.limit_s
        try:
            yield
        finally:
            self.deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.1)
            deadline = self.deadline
            if deadline is None or time.monotonic() < deadline:
                continue
            name, label, distributed = self.current
            if not self.fired and not distributed:
                self.fired = True
                self.deadline = time.monotonic() + self.GRACE_S
                _thread.interrupt_main()
                continue
            cl.dist.report({"exercise": name, "label": label, "rank": self.rank, "limit": True,
                            "message": self.stuck(name, distributed)})
            sys.stdout.flush()
            os._exit(3)

    def stuck(self, name: str, distributed: bool) -> str:
        """Where the cell is stuck, from its thread's stack: the line of the cell, and the collective it waits in."""
        frames = traceback.extract_stack(sys._current_frames().get(self.main))
        line = next((f.lineno for f in reversed(frames) if f.filename == f"<your {name}>"), None)
        where = f" (line {line} of your cell)" if line else ""
        waiting = next((f.name for f in reversed(frames) if f.filename.endswith("distributed_c10d.py")
                        and not f.name.startswith("_")), None)
        head = f"your {name} never returned within {self.limit_s:g} s"
        if distributed and waiting:
            return (f"{head}: rank {self.rank} waited in {waiting}{where} for ranks that never joined it; every rank "
                    "must make the same collective calls, in the same order")
        return f"{head}: still running{where} when stopped (a loop that never ends?)"


def verdict(name: str, source: str, rank: int = 0, world: int = 1, limits: Limits | None = None,
            label: str = "") -> str | None:
    """None when the cell's `name` passes its check, else the first difference (or the cell's own error, or the
    limit it ran into: `limits`, in the launched checks)."""
    namespace: dict = {"__name__": f"exercise_{name}"}
    filename = f"<your {name}>"
    bound = limits.bound(name, label, world > 1) if limits else contextlib.nullcontext()
    with bound, torch.random.fork_rng(devices=[]):  # the notebook's random state stays as it was
        try:
            try:
                code = compile(source, filename, "exec")
            except Exception as e:
                return f"your cell raised {_where(e, filename)}"
            try:
                exec(code, namespace)
            except Exception as e:
                return f"your cell raised {_where(e, filename)}"
            if name not in namespace or namespace[name] is ...:
                return f"your cell defines no `{name}`"
            message = None
            try:
                CHECKS[name](namespace[name], rank, world)
            except Differs as d:
                message = str(d)
            except MemoryError as e:
                message = _memory(name, e, filename, limits)
            except Exception as e:
                message = (_memory(name, e, filename, limits) if "can't allocate memory" in str(e)
                           or "not enough memory" in str(e) else f"your code raised {_where(e, filename)}")
            finish(message, world)
            return message
        except KeyboardInterrupt as e:
            if not (limits and limits.fired):
                raise
            return (f"your {name} never returned within {limits.limit_s:g} s: still running"
                    f"{_where(e, filename, only_line=True)} when stopped (a loop that never ends?)")
        finally:
            namespace.clear()
    return None


def _memory(name, error, filename, limits) -> str:
    gb = f"its {limits.memory_gb:g} GB" if limits else "the memory"
    return (f"your {name} ran out of {gb} (the check's limit){_where(error, filename, only_line=True)}: a list or "
            "tensor that keeps growing?")


def _where(error: BaseException, filename: str | None = None, only_line: bool = False) -> str:
    """`TypeError: ... (line 7 of your cell)`: the last line of the learner's cell in the traceback, and what the
    error usually means here (`HINTS`)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename.startswith("<your ")]
    filename = filename or (frames[-1].filename if frames else "<your >")
    lines = [f.lineno for f in frames if f.filename == filename]
    at = f" (line {lines[-1]} of your cell)" if lines else ""
    if only_line:
        return at
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    name = filename[len("<your "):-1]
    hint = next((h for pattern, names, h in HINTS if pattern in str(error) and (names is None or name in names)), "")
    return text + at + (f"; {hint}" if hint else "")


@dataclass
class Config(cl.config.RecipeConfig):
    """The checks of the build-it-yourself exercises: the learner's code against the real thing."""

    candidates: str = cl.config.opt("", "a JSON file: [[exercise, label, the source of a cell], ...], in order")
    limit_s: float = cl.config.opt(LIMIT_S, "seconds a candidate's check may run on a rank")
    memory_gb: float = cl.config.opt(MEMORY_GB, "GB a candidate may allocate beyond what the check holds (0: no limit)")

    def check(self) -> None:
        if self.candidates and not Path(self.candidates).is_file():
            raise cl.config.ConfigError(f"--candidates {self.candidates}: no such file")


def main(argv=None) -> None:
    args = Config.parse(argv)
    # The limits bound each candidate; the process group's own timeout only the waits between them (rank 0 checks
    # the single-process candidates while the others wait), so it is long.
    ctx = cl.dist.init(timeout_s=600, group_of_one=True)
    candidates = json.loads(Path(args.candidates).read_text())
    for name in dict.fromkeys(n for n, _, _ in candidates):
        if CHECKS[name].prepare and (CHECKS[name].ranks > 1 or ctx.rank == 0):
            CHECKS[name].prepare()
    limits = Limits(args.limit_s, args.memory_gb, ctx.rank)
    waited = False
    for name, label, source in candidates:
        distributed = CHECKS[name].ranks > 1
        if not distributed and ctx.rank != 0:
            continue
        if distributed and not waited and ctx.world_size > 1:  # the others wait, unbounded, for rank 0's singles
            torch.distributed.barrier()
            waited = True
        cl.dist.report({"exercise": name, "label": label, "rank": ctx.rank, "started": True})
        try:
            message = verdict(name, source, ctx.rank, ctx.world_size if distributed else 1, limits, label)
        except KeyboardInterrupt:  # the interrupt landed just after the check had answered
            if not limits.fired:
                raise
            message = f"your {name} never returned within {limits.limit_s:g} s"
        cl.dist.report({"exercise": name, "label": label, "rank": ctx.rank, "message": message})
    with contextlib.suppress(Exception):
        cl.dist.close()


if __name__ == "__main__":
    main()
    cl.dist.exit_now()  # (skips the interpreter's teardown: see exit_now)
