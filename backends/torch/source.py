"""A TorchLowering as the Python a user would have written by hand (`render`), and as the dump section that
says which part of the plan went to which engine and why (`report`).

The rendered code imports torch and the backend's hooks (autopar/backends/torch/hooks.py: checkpointing, gradient
buckets, the mean loss; plus autopar's mesh-flattening helper when FSDP shards over two mesh dims) and defines
`parallelize_plan`, `fsdp_units`, ... and `apply(model, mesh)`: the same steps, in the same order, as apply.py
runs on the recognized lowering; write it to a file, edit it, import it and call `apply`. autopar never executes
it (tests/test_torch_backend.py checks that it names what apply did).
"""

from __future__ import annotations

import re

from .mixed import report as parts_report


def _mesh_expr(names, dims) -> str:
    if len(dims) == 1:
        return f'mesh["{names[dims[0]]}"]'
    return f"mesh[({', '.join(repr(names[d]) for d in dims)})]"


def _fold(styles: dict, blocks: list[str]) -> dict:
    """Merge entries of repeated blocks that agree ('layers.0.x', 'layers.1.x', ... -> 'layers.*.x')."""
    by_prefix: dict = {}
    for b in blocks:
        prefix, i = b.rsplit(".", 1)
        by_prefix.setdefault(prefix, []).append(i)
    out, done = {}, set()
    for fqn, st in styles.items():
        if fqn in done:
            continue
        m = next(((p, fqn[len(p) + 1 :].split(".", 1)) for p in by_prefix if fqn.startswith(p + ".")), None)
        if m is not None and len(m[1]) == 2 and m[1][0] in by_prefix[m[0]]:
            prefix, (i, rest) = m[0], m[1]
            same = [f"{prefix}.{j}.{rest}" for j in by_prefix[prefix]]
            if all(s in styles and styles[s].code() == st.code() for s in same) and len(same) > 1:
                out[f"{prefix}.*.{rest}"] = st
                done.update(same)
                continue
        out[fqn] = st
        done.add(fqn)
    return out


def _wrap(items, indent, width=116) -> list:
    """repr of each item followed by a comma, packed into lines of at most `width` characters."""
    lines, line = [], ""
    for x in items:
        item = f"{x!r},"
        if line and len(indent) + len(line) + 1 + len(item) > width:
            lines.append(indent + line)
            line = ""
        line += (" " if line else "") + item
    return lines + ([indent + line] if line else [])


def _header(low) -> list:
    names = low.mesh_names
    mesh_desc = " x ".join(f"{n}={s}" for n, s in zip(names, low.mesh_shape))
    f8 = ["from autopar.backends.float8_linear import convert as convert_float8_linears"] if low.float8 else []
    return [
        f"# autopar plan {low.plan_hash} on mesh [{mesh_desc}], lowered to PyTorch's engines.",
        "# Printed by autopar.backends.torch.render(plan): the steps autopar.backends.torch.lower applies, as code to read,",
        "# edit and run by hand: `apply(model, mesh)` on every rank, where mesh is init_device_mesh(device_type,",
        f"# {tuple(low.mesh_shape)}, mesh_dim_names={tuple(names)}).",
        f"# Feed each rank its piece of the global batch: inputs placed {low.input_placements} over the mesh dims.",
        "import torch",
        "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard",
        "from torch.distributed.tensor import Replicate, Shard",
        "from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,",
        "                                               SequenceParallel, parallelize_module)",
        "",
        "from autopar.backends.torch.hooks import checkpoint_block, reduce_grads_in_buckets, weigh_mean_loss",
        *f8,
        "",
    ]


def _tp_section(low) -> list:
    styles = _fold(low.styles, low.block_fqns) if getattr(low, "block_fqns", None) else low.styles
    tp = low.mesh_names[low.tp_dim] if low.tp_dim is not None else None
    L = [
        f"# tensor parallelism on mesh dim {tp!r}: module FQN -> ParallelStyle"
        if tp
        else "# no tensor-parallel mesh dim"
    ]
    L.append("parallelize_plan = {")
    L += [f"    {fqn!r}: {st.code()}," for fqn, st in styles.items()]
    L.append("}")
    L.append(
        f"loss_parallel = {low.loss_parallel}   # True: run forward AND backward under "
        "torch.distributed.tensor.parallel.loss_parallel()"
    )
    return L + [""]


def _list(name, items, what) -> list:
    if not items:
        return [f"{name} = []   # {what}"]
    return [f"{name} = [   # {what}", *_wrap(items, "    "), "]"]


def _fsdp_section(low) -> list:
    L = ["# FSDP2 units, root last: (module FQN, fully_shard keyword arguments)", "fsdp_units = ["]
    for u in low.units:
        L.append(f"    ({u.fqn!r}, dict(reshard_after_forward={u.reshard_after_forward})),   # {u.why}")
    L.append("]")
    if low.mixed_precision:
        L.append(
            f"mp_policy = MixedPrecisionPolicy(param_dtype=torch.{low.mixed_precision['param_dtype']}, "
            f"reduce_dtype=torch.{low.mixed_precision['reduce_dtype']})"
        )
    else:
        L.append("mp_policy = MixedPrecisionPolicy()   # the plan keeps parameters in their own dtype")
    shard_dims = {f: k for u in low.units for f, k in u.shard_dims.items()}
    L.append(f"shard_dims = {shard_dims!r}   # parameters FSDP shards on a tensor dim other than 0")
    L += _list(
        "replicated_params", low.replicated_grads, "replicated on the data dims: gradients all-reduced (grad_buckets)"
    )
    if low.parts:
        L.append(
            f"# autopar's graph backend runs the modules {sorted(low.parts)} (the engines cannot express their plan):"
        )
        L.append("# after apply(), autopar.backends.torch.mixed.install_parts puts each on its own Program.")
    what = (
        f"the graph backend runs {sorted(low.parts)}: FSDP ignores these"
        if low.part_params
        else "parameters of the modules the graph backend runs"
    )
    L += _list("part_params", low.part_params, what)
    L.append(f"checkpoint_blocks = {low.checkpoint!r}   # activation checkpointing (recomputed in the backward)")
    if low.float8:
        L += _list("float8_linears", low.float8, "nn.Linear modules computing in float8 (tensorwise scales)")
    return L


def _buckets_section(low) -> list:
    names, buckets = low.mesh_names, getattr(low, "grad_buckets", [])
    L = []
    if buckets:
        L.append(
            f"# gradients of the replicated parameters, averaged over the {low.batch_shards} batch shards in "
            "buckets: (steps, parameter FQNs"
        )
        L.append(
            "# in the order the backward produces them). Each step is one all_reduce over the named mesh dims "
            "(several: their"
        )
        L.append("# flattened group); a bucket's steps run one after the other.")
    L.append("grad_buckets = [" + ("" if buckets else "]"))
    for b in buckets:
        steps = ", ".join(
            "(" + ", ".join(repr(names[d]) for d in s) + ("," if len(s) == 1 else "") + ")" for s in b.steps
        )
        src = (
            f"plan bucket {b.planned}"
            if b.planned is not None
            else "not a plan bucket: the plan reduces these gradients otherwise"
        )
        L.append(f"    ([{steps}], [   # {src}: {b.nbytes:,d} B {b.dtype} per step")
        L += _wrap(b.params, "        ")
        L.append("    ]),")
    if buckets:
        L.append("]")
    L.append(
        f"batch_shards = {getattr(low, 'batch_shards', 1)}   # ranks that split the batch: gradients are "
        "averaged over them"
    )
    ml = low.mean_loss
    L.append(
        f"mean_loss = {(ml['labels'], ml['ignore_index']) if ml else None!r}   # (position of the labels among "
        "the forward's arguments, ignore_index): each rank's mean weighted by its counted targets"
    )
    return L + ["", "", f"blocks = {list(low.block_fqns)!r}   # the repeated blocks", "", ""]


def _fsdp_calls(low) -> list:
    names, L = low.mesh_names, []
    if len(low.shard_dims) > 1:
        shard_expr = "flatten_mesh(mesh, (" + ", ".join(repr(names[d]) for d in low.shard_dims) + ",))"
        L.append("    from autopar.strategies._torch_adapter import flatten_mesh")
        L.append(f"    dp_mesh = {shard_expr}")
    else:
        L.append(
            f"    dp_mesh = {_mesh_expr(names, low.replicate_dims + low.shard_dims)}"
            + ("   # HSDP: (replicate, shard)" if low.replicate_dims else "")
        )
    L.append("    ignored = {model.get_parameter(f) for f in replicated_params + part_params}")
    L.append(
        "    place = lambda p: next((Shard(k) for f, k in shard_dims.items() if model.get_parameter(f) is p), None)"
    )
    L.append("    for fqn, kw in fsdp_units:")
    L.append(
        "        fully_shard(model.get_submodule(fqn), mesh=dp_mesh, mp_policy=mp_policy, "
        "ignored_params=ignored or None,"
    )
    L.append("                    shard_placement_fn=place if shard_dims else None, **kw)")
    return L


def _apply_section(low) -> list:
    names, data = low.mesh_names, low.replicate_dims + low.shard_dims
    L = [
        "def apply(model, mesh, compile_blocks=None):",
        '    """compile_blocks: None, or torch.compile keyword arguments to compile each block in place after TP and',
        '    checkpointing and before FSDP (torchtitan\'s order)."""',
    ]
    if low.float8:  # torchao's tensorwise Float8Linear math, before the styles wrap the linears
        L.append("    convert_float8_linears(model, float8_linears)")
    if low.tp_dim is not None:
        L.append(f'    parallelize_module(model, mesh["{names[low.tp_dim]}"], parallelize_plan)')
    L.append("    for fqn in checkpoint_blocks:")
    L.append("        checkpoint_block(model.get_submodule(fqn))")
    L.append("    if compile_blocks is not None:")
    L.append("        for fqn in blocks:")
    L.append("            model.get_submodule(fqn).compile(**compile_blocks)")
    if low.units:
        L += _fsdp_calls(low)
    if low.replicated_grads and data:
        L.append("    reduce_grads_in_buckets(model, mesh, grad_buckets, batch_shards)")
    ml = low.mean_loss
    if ml:
        L.append(f"    weigh_mean_loss(model, mesh, {tuple(names[d] for d in data)!r}, *mean_loss, {ml['shards']})")
    L.append("    return model")
    return L


def source_of(low) -> str:
    """The lowering as the code a user would have written (module docstring): printed, never executed here."""
    L = _header(low) + _tp_section(low) + _fsdp_section(low) + _buckets_section(low) + _apply_section(low)
    return "\n".join(L) + "\n"


def report(low) -> str:
    """Which part of the plan each engine runs and why; the parts the engines cannot express, and why."""
    names = low.mesh_names
    L = [
        "lowering to torch engines: "
        + (
            f"every part expressible but {len(low.parts)} module(s) the graph backend runs"
            if low.expressible and low.parts
            else "every part expressible"
            if low.expressible
            else f"{len(low.reasons)} part(s) NOT expressible"
        )
    ]
    roles = []
    for d, n in enumerate(names):
        role = (
            "FSDP shard"
            if d in low.shard_dims
            else "data-parallel replicate"
            if d in low.replicate_dims
            else "tensor parallel"
            if d == low.tp_dim
            else "idle (replicated compute)"
            if d in low.idle_dims
            else "?"
        )
        roles.append(f"{n}: {role}")
    L.append("  mesh dims: " + ", ".join(roles))
    for u in low.units:
        L.append(
            f"  -> torch  fully_shard({u.fqn or '<root>'}, reshard_after_forward={u.reshard_after_forward})"
            f"  because {u.why}"
        )
    for fqn, st in low.styles.items():
        L.append(f"  -> torch  {fqn}: {st.code()}" + (f"  because {st.why}" if st.why else ""))
    for b in getattr(low, "grad_buckets", []):
        steps = " then ".join("+".join(names[d] for d in s) for s in b.steps)
        L.append(
            f"  -> torch  gradient hook: all_reduce over {steps} of {len(b.params)} replicated gradients "
            f"({b.nbytes:,d} B {b.dtype}), averaged over {low.batch_shards} batch shards  because "
            + (f"plan bucket {b.planned}" if b.planned is not None else "the plan reduces them otherwise")
        )
    if low.loss_parallel:
        L.append("  -> torch  loss_parallel(): the loss input is vocab-sharded on the tensor-parallel dim")
    if low.mean_loss:
        data = low.replicate_dims + low.shard_dims
        L.append(
            f"  -> torch  loss hook: each rank's mean loss weighted by its counted targets (labels = forward "
            f"argument {low.mean_loss['labels']}, ignore_index {low.mean_loss['ignore_index']}), one all_reduce "
            f"over {'+'.join(names[d] for d in data)} ({low.mean_loss['nbytes']} B)  because the plan's mean is "
            f"the loss sum over the batch's counted targets"
        )
    if low.float8:
        n = len(low.float8)
        L.append(f"  -> torch  {n} nn.Linear modules in float8 (tensorwise, torch._scaled_mm; planner decision)")
    if low.mixed_precision:
        L.append(f"  -> torch  MixedPrecisionPolicy({low.mixed_precision}) on every FSDP unit (planner decision)")
    if low.checkpoint:
        L.append(f"  -> torch  torch.utils.checkpoint around {low.checkpoint} (planner decision)")
    for n in low.notes:
        L.append(f"  note: {n}")
    for part, why in low.reasons:
        L.append(f"  -> graph  {part}: {why}")
    if getattr(low, "parts", None):
        L += parts_report(low)
    return "\n".join(L)


def short(fqn: str) -> str:
    return re.sub(r"\.(\d+)\.", ".*.", fqn)
