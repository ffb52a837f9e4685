"""Tensor parallelism, three ways, each checked against the unsplit model (chapter 08).

1. `ColumnParallelLinear` / `RowParallelLinear` (course_lib.parallel.tensor_parallel) against `nn.Linear`.
2. A Qwen2 MLP and attention block split the Megatron way: same outputs, same gradients.
3. PyTorch's `torch.distributed.tensor.parallel` (ColwiseParallel / RowwiseParallel) on a whole
   Qwen2 model over a 2-D device mesh (data × model): per-rank parameter bytes, logits, gradients.
4. Communication and activations (course_lib.parallel.comm): every layer's collectives with PyTorch's TP plan,
   without and with sequence parallelism, counted; their plain forwards timed in turns; one layer's saved
   activation bytes.
5. FSDP2 × TP: FSDP2 over the mesh's data dimension, the TP plan over its model dimension.

    torchrun --nproc-per-node=2 tp.py --meshes 1x2 2x1         # 2 ranks: pure TP, then pure DP
    torchrun --nproc-per-node=8 tp.py --meshes 2x4 --hidden-size 896 --num-attention-heads 16 ...
"""
import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

import course_lib as cl
from course_lib.parallel import tensor_parallel as tpl


@dataclass
class Config(cl.config.RecipeConfig, cl.config.ModelSize):
    """Tensor parallelism, three ways, each checked against the unsplit model (chapter 08)."""

    chapter = "08"
    meshes: tuple[str, ...] = cl.config.opt(("1x2",), "data x model mesh shapes to run, e.g. 1x2 2x1")
    global_batch: int = cl.config.preset("sequences of the whole batch, split over the data dimension",
                                         knob="batch_size")
    seq_len: int = cl.config.preset("tokens per sequence")
    seed: int = cl.config.preset("seed of the model and the data")
    repeat: int = cl.config.preset("plain forwards timed per plan, TP and TP + SP in turns", knob="tp_repeat")


def max_diff(a, b) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def linear_checks(ctx, args, group) -> dict:
    """Part 1: one Linear split by columns (outputs) and by rows (inputs) over the tensor-parallel group."""
    torch.manual_seed(args.seed)  # the same full layer and input on every rank
    h = args.hidden_size
    dev = ctx.device  # the model's device: under nccl the collectives move GPU tensors only
    full = torch.nn.Linear(h, 4 * h, device=dev)
    x = torch.randn(args.global_batch, args.seq_len, h, requires_grad=True, device=dev)
    probe = torch.randn(args.global_batch, args.seq_len, 4 * h, device=dev)  # loss = <y, probe>: every output matters

    (full(x) * probe).sum().backward()
    ref_y, ref_dx, ref_dw, ref_db = full(x).detach(), x.grad.clone(), full.weight.grad.clone(), full.bias.grad.clone()

    out = {}
    x.grad = None
    col = tpl.ColumnParallelLinear.from_linear(full, group, gather_output=True)
    with cl.comm.CommCounter() as comm:
        y = col(x)
        (y * probe).sum().backward()
    out["column_comm"] = comm.summary()
    out["column_y"] = max_diff(y, ref_y)
    out["column_dx"] = max_diff(x.grad, ref_dx)
    out["column_dw"] = max_diff(col.weight.grad, tpl.local_shard(ref_dw, 0, group))
    out["column_db"] = max_diff(col.bias.grad, tpl.local_shard(ref_db, 0, group))
    out["column_weight_shape"] = list(col.weight.shape)

    full2 = torch.nn.Linear(4 * h, h, device=dev)
    x2 = torch.randn(args.global_batch, args.seq_len, 4 * h, requires_grad=True, device=dev)
    probe2 = torch.randn(args.global_batch, args.seq_len, h, device=dev)
    (full2(x2) * probe2).sum().backward()
    ref_y2, ref_dx2, ref_dw2 = full2(x2).detach(), x2.grad.clone(), full2.weight.grad.clone()
    x2.grad = None
    row = tpl.RowParallelLinear.from_linear(full2, group, input_is_parallel=False)
    with cl.comm.CommCounter() as comm:
        y2 = row(x2)
        (y2 * probe2).sum().backward()
    out["row_comm"] = comm.summary()
    out["row_y"] = max_diff(y2, ref_y2)
    out["row_dx_local"] = max_diff(tpl.local_shard(x2.grad, -1, group), tpl.local_shard(ref_dx2, -1, group))
    out["row_dw"] = max_diff(row.weight.grad, tpl.local_shard(ref_dw2, 1, group))
    out["row_weight_shape"] = list(row.weight.shape)
    return out


def block_checks(ctx, args, model, group) -> dict:
    """Part 2: the first decoder layer's MLP and attention, Megatron-split, vs the unsplit blocks."""
    layer = model.model.layers[0]
    torch.manual_seed(args.seed + 1)
    x = torch.randn(args.global_batch, args.seq_len, args.hidden_size, device=ctx.device)
    pos = torch.arange(args.seq_len, device=ctx.device).unsqueeze(0)
    pe = model.model.rotary_emb(x, pos)
    out = {}
    blocks = {
        "mlp": (layer.mlp, tpl.megatron_mlp(layer.mlp, group), lambda m, inp: m(inp)),
        "attn": (layer.self_attn, tpl.megatron_attention(layer.self_attn, group),
                 lambda m, inp: m(inp, position_embeddings=pe, attention_mask=None)[0]),
    }
    for name, (full, split, call) in blocks.items():
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        y_full, y_tp = call(full, xs[0]), call(split, xs[1])
        y_full.square().mean().backward()
        y_tp.square().mean().backward()
        out[f"{name}_y"] = max_diff(y_tp, y_full)
        out[f"{name}_dx"] = max_diff(xs[1].grad, xs[0].grad)
        worst = 0.0  # every weight shard's gradient vs the same slice of the full gradient
        full_params, owners = dict(full.named_parameters()), dict(split.named_modules())
        for pname, p in split.named_parameters():
            ref, owner = full_params[pname].grad, owners[pname.rsplit(".", 1)[0]]
            if isinstance(owner, tpl.ColumnParallelLinear):  # weight and bias split by output features
                ref = tpl.local_shard(ref, 0, group)
            elif isinstance(owner, tpl.RowParallelLinear) and pname.endswith("weight"):  # by input features
                ref = tpl.local_shard(ref, 1, group)
            worst = max(worst, max_diff(p.grad, ref))
        out[f"{name}_dw"] = worst
        out[f"{name}_param_bytes_full"] = sum(p.numel() * p.element_size() for p in full.parameters())
        out[f"{name}_param_bytes_rank"] = sum(p.numel() * p.element_size() for p in split.parameters())
        full.zero_grad()
    return out


def make_mesh(ctx, shape: str, model: dict):
    """A (data, model) device mesh from "DPxTP", e.g. "2x4": 2 data-parallel rows of 4-way tensor parallelism."""
    from torch.distributed.device_mesh import init_device_mesh

    dp, tp = (int(n) for n in shape.lower().split("x"))
    if dp * tp != ctx.world_size:
        raise SystemExit(f"mesh {shape} needs {dp * tp} ranks, this run has {ctx.world_size}")
    if tp not in tpl.tp_degrees(model, tp):
        raise SystemExit(f"mesh {shape}: {model['num_attention_heads']} query / {model['num_key_value_heads']} key-value "
                         f"heads do not split over {tp} ranks; tensor-parallel degrees that do: {tpl.tp_degrees(model)}")
    return init_device_mesh(ctx.device.type, (dp, tp), mesh_dim_names=("data", "model"))


def dtensor_checks(ctx, args, model, mesh) -> dict:
    """Part 3: torch.distributed.tensor.parallel on the whole model over a (data, model) mesh."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dp, tp = mesh.shape
    dp_rank = mesh.get_local_rank("data")
    ref = model  # the unsplit model, on the whole batch
    batch = cl.models.random_batch(ref.config.vocab_size, args.global_batch, args.seq_len, seed=args.seed, device=ctx.device)
    ref.zero_grad()
    ref_out = ref(**batch)
    ref_out.loss.backward()

    tp_model = copy.deepcopy(ref)
    tp_model.zero_grad()
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in tp_model.model.layers:
        parallelize_module(layer, mesh["model"], plan)

    # This data-parallel rank's share of the batch; the model dimension sees the same rows.
    rows = slice(dp_rank * args.global_batch // dp, (dp_rank + 1) * args.global_batch // dp)
    mine = {k: v[rows] for k, v in batch.items()}
    start = cl.timing.now()
    out = tp_model(**mine)
    out.loss.backward()
    seconds = cl.timing.now() - start
    for p in tp_model.parameters():  # data parallel: average the gradients over the data dimension
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if dp > 1:
            dist.all_reduce(g, group=mesh.get_group("data"))
            g /= dp

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    sharded, replicated, sharded_full = 0, 0, 0
    ref_params = dict(ref.named_parameters())
    worst_grad = 0.0
    for name, p in tp_model.named_parameters():
        nbytes = local(p).numel() * p.element_size()
        if isinstance(p, DTensor) and local(p).shape != p.shape:
            sharded += nbytes
            sharded_full += p.numel() * p.element_size()
        else:
            replicated += nbytes
        worst_grad = max(worst_grad, max_diff(full(p.grad), ref_params[name].grad))
    logits = local(out.logits)
    return {
        "mesh": [dp, tp],
        "logits_max_diff": max_diff(logits, ref_out.logits[rows]),
        "loss": out.loss.item(), "loss_full_batch": ref_out.loss.item(),
        "grad_max_diff": worst_grad,
        "param_bytes_rank": sharded + replicated, "param_bytes_full": sum(p.numel() * p.element_size() for p in ref.parameters()),
        "sharded_bytes_rank": sharded, "sharded_bytes_full": sharded_full, "replicated_bytes": replicated,
        "fwd_bwd_s": seconds,
    }


def tp_model(model, mesh, sp: bool):
    """A copy of the model with PyTorch's TP plan on every layer; with `sp`, the sequence stays split between the
    layers: cut at the first layer's input (no communication), gathered again before the final norm."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    m = copy.deepcopy(model)
    for layer in m.model.layers:
        parallelize_module(layer, mesh, tpl.qwen2_plan(sp))
    if sp:
        for module, (have, want) in ((m.model.layers[0], (Replicate(), Shard(1))), (m.model.norm, (Shard(1), Replicate()))):
            parallelize_module(module, mesh, PrepareModuleInput(input_layouts=(have,), desired_input_layouts=(want,),
                                                                use_local_output=True))
    return m


def comm_and_activations(ctx, args, model, mesh) -> dict:
    """Part 4 over the model dimension of `mesh`: per layer, what TP and TP + SP send (counted, tagged by layer),
    their plain forwards timed in turns; one decoder layer's saved bytes unsplit, with TP, with TP + SP."""
    t, rank = mesh.size(), mesh.get_local_rank()
    batch = cl.models.random_batch(args.vocab_size, args.global_batch, args.seq_len, seed=args.seed, device=ctx.device)
    x = torch.randn(args.global_batch, args.seq_len, args.hidden_size,
                    generator=torch.Generator().manual_seed(args.seed)).to(ctx.device)
    pe = model.model.rotary_emb(x, torch.arange(args.seq_len, device=ctx.device).unsqueeze(0))
    out, plain = {"tokens": args.global_batch * args.seq_len}, {}
    for mode in ("none", "tp", "sp"):
        layer = copy.deepcopy(model.model.layers[0])
        if mode != "none":
            from torch.distributed.tensor.parallel import parallelize_module
            parallelize_module(layer, mesh, tpl.qwen2_plan(mode == "sp"))
        xi = (x.chunk(t, dim=1)[rank] if mode == "sp" else x).clone().requires_grad_(True)
        with cl.SavedTensors(layer) as saved:
            y = layer(xi, attention_mask=None, position_embeddings=pe)
        y.square().mean().backward()
        out[mode] = {"layer_saved_bytes": saved.bytes}
        if mode == "none":
            continue
        m = plain[mode] = tp_model(model, mesh, mode == "sp")
        layers = {f"L{i}": layer for i, layer in enumerate(m.model.layers)}
        m(**batch).loss.backward()  # warm-up
        with cl.comm.CommCounter() as comm:
            handles = cl.comm.tag_modules(comm, {**layers, "norm": m.model.norm})
            m(**batch).loss.backward()
        for h in handles:
            h.remove()
        out[mode]["comm"] = cl.comm.traffic(comm)

    def forward(m):  # the ranks start together; a plain forward, nothing counted
        def run():
            dist.barrier()
            with torch.no_grad():
                m(**batch)
        return run

    spreads = cl.timing.interleaved({mode: forward(m) for mode, m in plain.items()}, repeat=args.repeat)
    for mode, spread in spreads.items():  # every rank's seconds: the notebook compares the slower rank's
        out[mode]["forward_s_ranks"] = cl.dist.gather(spread.samples, ctx)
    return out


def fsdp_tp_checks(ctx, args, model, mesh) -> dict:
    """Part 5: FSDP2 over the data dimension, the TP plan over the model dimension (the 2-D mesh of PyTorch's TP
    tutorial): loss and gradients vs the unsplit model, and the bytes of projections each rank holds."""
    from torch.distributed.tensor.parallel import parallelize_module

    dp, _ = mesh.shape
    m = copy.deepcopy(model)
    for layer in m.model.layers:  # TP first, inside each layer; then FSDP2's units over the data dimension
        parallelize_module(layer, mesh["model"], tpl.qwen2_plan())
    cl.fsdp2.shard_model(m, mesh["data"])
    batch = cl.models.random_batch(model.config.vocab_size, args.global_batch, args.seq_len, seed=args.seed, device=ctx.device)
    rows = slice(mesh.get_local_rank("data") * args.global_batch // dp, (mesh.get_local_rank("data") + 1) * args.global_batch // dp)
    model.zero_grad()
    ref_loss = model(**batch).loss
    ref_loss.backward()
    with cl.comm.CommCounter() as comm:
        loss = m(**{k: v[rows] for k, v in batch.items()}).loss
        loss.backward()
    ref = dict(model.named_parameters())
    proj = [(n, p) for n, p in m.named_parameters() if n.endswith("proj.weight")]
    return {"mesh": list(mesh.shape), "loss_mean": cl.dist.all_reduce_scalar(loss.item(), "mean"), "loss_ref": ref_loss.item(),
            "grad_max_diff": max(max_diff(p.grad.full_tensor(), ref[n].grad) for n, p in m.named_parameters()),
            "proj_bytes_rank": sum(p.to_local().numel() * p.element_size() for _, p in proj),
            "proj_bytes_full": sum(p.numel() * p.element_size() for _, p in proj), "comm": comm.summary()}


def main(argv=None):
    args = Config.parse(argv)
    ctx = cl.dist.init(group_of_one=True)  # one rank too: a group of one, so the same code (meshes, barriers) runs
    model = cl.models.tiny_qwen2(seed=args.seed, **args.size()).to(ctx.device)
    meshes = {shape: make_mesh(ctx, shape, args.size()) for shape in args.meshes}
    group = meshes[args.meshes[0]].get_group("model")  # parts 1-2 run over the first mesh's model dimension
    result = {"world_size": ctx.world_size, "tp_size": meshes[args.meshes[0]].shape[1],
              "linear": linear_checks(ctx, args, group), "blocks": block_checks(ctx, args, model, group)}
    result["comm"] = comm_and_activations(ctx, args, model, meshes[args.meshes[0]]["model"])
    result["fsdp_tp"] = {shape: fsdp_tp_checks(ctx, args, model, mesh) for shape, mesh in meshes.items()}
    result["meshes"] = {}
    for shape, mesh in meshes.items():
        per_rank = cl.dist.gather(dtensor_checks(ctx, args, model, mesh), ctx)
        result["meshes"][shape] = per_rank
        cl.dist.rprint(f"mesh {shape} (data × model): logits diff {max(r['logits_max_diff'] for r in per_rank):.2e}, "
                       f"grad diff {max(r['grad_max_diff'] for r in per_rank):.2e}, "
                       f"params/rank {per_rank[0]['param_bytes_rank']:,} of {per_rank[0]['param_bytes_full']:,} B", ctx=ctx)
    # parts 1 and 2 from every rank (each holds a different shard)
    result["linear"] = cl.dist.gather(result["linear"], ctx)
    result["blocks"] = cl.dist.gather(result["blocks"], ctx)
    cl.dist.finish(result)


if __name__ == "__main__":
    main()
    cl.dist.exit_now()  # (skips the interpreter's teardown: see exit_now)
