"""Correct answers to the build exercises written otherwise than the references (course_lib/workbook/solutions/),
as a learner might: every check must accept them (tests/test_builds.py). A cell's text each, run on its own."""

ALTERNATIVES = {
    "LossScaler": {
        "a tensor scale, unscaled by its inverse": '''
import torch


class LossScaler:
    def __init__(self, init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.s = torch.tensor(float(init_scale))
        self.g, self.b, self.n = growth_factor, backoff_factor, growth_interval
        self.tracker, self.skipped = 0, False

    def scale(self, loss):
        return loss * self.s

    def step(self, optimizer):
        inv, finite = 1.0 / self.s, True
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(inv)
                    finite = finite and bool(torch.isfinite(p.grad).all())
        self.skipped = not finite
        if finite:
            optimizer.step()

    def update(self):
        if self.skipped:
            self.s, self.tracker = self.s * self.b, 0
            return
        self.tracker += 1
        if self.tracker >= self.n:
            self.s, self.tracker = self.s * self.g, 0

    def get_scale(self):
        return float(self.s)
''',
    },
    "checkpointed": {
        "torch.autograd.grad, the weights' gradients added by hand": '''
import torch


class Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, block):
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        params = [p for p in ctx.block.parameters() if p.requires_grad]
        with torch.enable_grad():
            y = ctx.block(x)
        grads = torch.autograd.grad(y, [x, *params], grad)
        for p, g in zip(params, grads[1:]):
            p.grad = g if p.grad is None else p.grad + g
        return grads[0], None


def checkpointed(block, x):
    return Recompute.apply(x, block)
''',
    },
    "ddp_from_hooks": {
        "hooks on the incoming gradient, the state dict broadcast": '''
import torch.distributed as dist
from torch import nn


def _average(grad):
    grad = grad.clone()
    dist.all_reduce(grad)
    return grad / dist.get_world_size()


class Wrapped(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def ddp_from_hooks(model):
    for t in model.state_dict().values():  # parameters, frozen or not, and buffers: views of the model's own
        dist.broadcast(t, src=0)
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(_average)
    return Wrapped(model)
''',
        "ReduceOp.AVG (gloo has it), a class of its own": '''
import torch.distributed as dist
from torch import nn


class ddp_from_hooks(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.module = model
        for p in model.parameters():
            dist.broadcast(p.detach(), src=0)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad, op=dist.ReduceOp.AVG))

    def forward(self, x):
        return self.module(x)
''',
        "the course library's DataParallelNaive": '''
from course_lib.parallel.data_parallel import DataParallelNaive

ddp_from_hooks = DataParallelNaive
''',
    },
    "ZeroOneAdamW": {
        "a flat partition padded to a multiple of the ranks": '''
import torch
import torch.distributed as dist


class ZeroOneAdamW:
    def __init__(self, params, lr=1e-3, weight_decay=0.0):
        self.params = list(params)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.total = sum(p.numel() for p in self.params)
        self.size = -(-self.total // self.world)
        self.shard = torch.nn.Parameter(self.flat([p.detach() for p in self.params]).clone())
        self.optimizer = torch.optim.AdamW([self.shard], lr=lr, weight_decay=weight_decay)

    def flat(self, tensors):
        whole = torch.zeros(self.size * self.world)
        whole[:self.total] = torch.cat([t.flatten() for t in tensors])
        return whole[self.rank * self.size:(self.rank + 1) * self.size]

    def step(self):
        self.shard.grad = self.flat([p.grad for p in self.params]).clone()
        self.optimizer.step()
        whole = torch.empty(self.size * self.world)
        dist.all_gather_into_tensor(whole, self.shard.detach())
        at = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(whole[at:at + p.numel()].view_as(p))
                at += p.numel()
''',
    },
    "ShardedLinear": {
        "all-gather to a list, all-reduce then slice in backward": '''
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part):
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, part.contiguous())
        ctx.rows = part.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        r = dist.get_rank()
        return grad[r * ctx.rows:(r + 1) * ctx.rows] / dist.get_world_size()


class ShardedLinear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        self.weight = nn.Parameter(linear.weight.detach().chunk(world)[rank].clone())
        self.bias = nn.Parameter(linear.bias.detach().chunk(world)[rank].clone())

    def forward(self, x):
        return F.linear(x, Gather.apply(self.weight), Gather.apply(self.bias))
''',
    },
    "tp_mlp": {
        "chunks, and the bias added after the sum": '''
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


class Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


class Block(nn.Module):
    def __init__(self, fc1, fc2):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        h = F.gelu(self.fc1(Copy.apply(x)))
        return Reduce.apply(h @ self.fc2.weight.T) + self.fc2.bias


def tp_mlp(fc1, fc2):
    rank, world = dist.get_rank(), dist.get_world_size()
    a = nn.Linear(fc1.in_features, fc1.out_features // world)
    b = nn.Linear(fc1.out_features // world, fc2.out_features)
    with torch.no_grad():
        a.weight.copy_(fc1.weight.chunk(world, 0)[rank])
        a.bias.copy_(fc1.bias.chunk(world)[rank])
        b.weight.copy_(fc2.weight.chunk(world, 1)[rank])
        b.bias.copy_(fc2.bias)
    return Block(a, b)
''',
    },
    "LoRALinear": {
        "F.linear twice, the base frozen parameter by parameter": '''
import math

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Module):
    def __init__(self, base, r, alpha):
        super().__init__()
        self.lin, self.scaling = base, alpha / r
        for p in self.lin.parameters():
            p.requires_grad = False
        self.A = nn.Parameter(torch.empty(r, base.in_features))
        self.B = nn.Parameter(torch.zeros(base.out_features, r))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))

    def forward(self, x):
        return self.lin(x) + F.linear(F.linear(x, self.A), self.B) * self.scaling
''',
    },
    "assistant_mask": {
        "a regular expression's spans, offsets to tokens": '''
import re


def assistant_mask(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = [m.span(1) for m in re.finditer(r"<\\|im_start\\|>assistant\\n(.*?<\\|im_end\\|>)", text, re.S)]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [1 if any(a <= start < b for a, b in spans) else 0 for start, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask
''',
    },
}
