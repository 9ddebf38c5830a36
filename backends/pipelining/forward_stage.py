"""Pipeline stages that run the model's own forward: for models called with keyword inputs (a transformers model's
`input_ids=`, `labels=`, the loss computed inside), whose forward outside the layer list is no chain of modules
(GPT-2 adds position embeddings, Llama builds RoPE tables and a causal mask, the loss shifts the labels).

Stage k is a skeleton of the model: the same module tree and FQNs, its own modules shared with the model, every
module of another stage replaced by a parameter-free stand-in, so the stage holds exactly the plan's parameters
for it (`plan.stages[k]["params"]`):
  * another stage's block hands the running tensor on in the block's own output structure;
  * a module before the blocks that holds parameters (the embedding) returns its output as probed, each tensor
    zero, so the forward still builds what the blocks take besides the running tensor (masks, RoPE tables:
    parameter-free modules stay) and the first block of the stage takes the received activation instead; where
    later blocks or the head read its output (a position bias, an encoder's output), it returns the tensors the
    first stage sent with the running tensor (side_values.py);
  * a module after the blocks that holds parameters (final norm, head) raises (never run before the last stage:
    the stage's last block ends the forward there).
Each stand-in keeps the module's tree and attributes, its parameters as meta tensors that are no parameters
(`_ghost`): a model's forward may read `self.embeddings.patch_embeddings.projection.weight.dtype`.
Every stage runs the whole call (each rank gets the model's inputs as keyword arguments, micro-batched by the
schedule): the first block of a later stage takes the activation received from the previous stage in place of
its running tensor, the last block of an earlier stage ends the forward and its running tensor is sent on, and
the last stage runs to the model's own loss (autopar/model_io.py pick_loss). The stand-ins' shapes and each
block's input and output structure come from one probe forward on the first micro-batch (no gradients, the RNG
state restored after it). The first `recompute_blocks` blocks of the stage are checkpointed, as the chain stages'.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import types
from collections import defaultdict

import torch
import torch.utils._pytree as pytree
from torch import nn

from autopar.model_io import pick_loss

from . import batch_split, side_values


class _StageEnd(Exception):
    """Raised by the stage's last block (before the last stage): the running tensor goes to the next stage."""

    def __init__(self, hidden):
        super().__init__()
        self.hidden = hidden


def _hidden_of(args, kwargs):
    """The running tensor a block takes: its first positional argument or `hidden_states=`."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return kwargs.get("hidden_states")


def _stand_in_value(value):
    """What another stage's stand-in returns for a block output after its running tensor: None for None or a tensor
    nothing outside the block reads (GPT-Neo's and BLOOM's attention weights, Swin's reshaped states; check_plan
    refuses a plan whose graph reads one), the probed value for a shape value (Swin-v2's output dimensions, alike for
    every micro-batch); _NOT_HANDED for anything else (a cache or other object the model may keep using)."""
    if value is None or isinstance(value, torch.Tensor):
        return None
    return value if side_values.shape_value(value) else _NOT_HANDED


_NOT_HANDED = object()


def _skip(fqn, template, holder, seen, recv=False, end=False):
    """Another stage's block: hands its running tensor on, in the block's own tuple or list where it returns one
    (`template`: that type and the values after the running tensor, its side outputs the received ones). On a
    stage that holds no block, the block just before it hands on the received activation (recv) instead, and the
    block just after it ends the stage's forward with its running tensor (end)."""

    def forward(self, *args, **kwargs):
        h = holder["recv"] if recv else _hidden_of(args, kwargs)
        if end:
            raise _StageEnd(h)
        if template is None:
            return h
        return template[0]((h,) + side_values.received(fqn, template[1], seen["sides"], seen["aliases"], holder))

    return forward


def _zeros(made: tuple):
    """Another stage's module before the blocks: its output as probed (side_values.Tracker.made: a tree of tensors
    and shape values, e.g. Swin's patch embedding and the patch grid's (height, width), CLIP's vision tower output),
    each tensor a zero tensor of its shape and dtype."""
    spec, leaves = made

    def forward(self, *args, **kwargs):
        dev = next((a.device for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
        zero = lambda v: torch.zeros(v.shape, dtype=v.dtype, device=dev) if isinstance(v, torch.Tensor) else v
        return pytree.tree_unflatten([zero(v) for v in leaves], spec)

    return forward


def _tensor_or_shape(v) -> bool:
    return isinstance(v, torch.Tensor) or side_values.shape_value(v)


def _kinds(leaves) -> str:
    return ", ".join(sorted({type(v).__name__ for v in leaves if not _tensor_or_shape(v)}))


def _unreached(fqn: str):
    """Another stage's module after the blocks: the stage's last block ends the forward before it."""

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"pipeline stage ran '{fqn}', a module of a later stage, before its last block")

    return forward


def _ghost(mod: nn.Module, forward=None) -> nn.Module:
    """A stand-in for another stage's module: its tree and attributes (a model's forward reads
    `self.embeddings.patch_embeddings.projection.weight.dtype`, `layer.attention_type`) with its parameters as
    meta tensors that are no parameters (the stage does not hold them), running `forward` in its place."""
    c = _shallow(mod)
    for name, p in mod._parameters.items():
        del c._parameters[name]
        if p is not None:
            object.__setattr__(c, name, p.detach().to("meta"))
    for name, child in mod._modules.items():
        if child is not None:
            c._modules[name] = _ghost(child)
    if forward is not None:
        c.forward = types.MethodType(forward, c)
    return c


def check_plan(plan) -> None:
    """Refuse, naming the block, a plan whose forward graph (the representative sub-model's, plan.nodes) carries
    what the stages cannot: a module with parameters run between two blocks, a block's running tensor read after
    the last block (every hidden state collected), or, in a plan of chained modules (positional inputs), a block
    value read after it besides its running tensor (an MoE router's logits for the aux loss) or a value made from
    parameters before the blocks read elsewhere than by the first block (stages running the model's own forward
    send those on: side_values.py)."""
    prefix = plan.schedule["layer_prefix"]
    pat = re.compile(rf"^{re.escape(prefix)}\.(\d+)(?:\.|$)")
    fw = [n for n in plan.nodes if n.get("kind") == "op" and n.get("phase") == "fw"]
    block = {n["idx"]: int(m.group(1)) for n in fw if (m := pat.match(n.get("module") or ""))}
    if not block:
        return
    start, first = min(block), min(block.values())
    params = {n["idx"] for n in plan.nodes if n.get("kind") == "param"}
    from_params = set(params)
    for n in plan.nodes:
        if any(p in from_params for p, _ in n.get("inputs", [])):
            from_params.add(n["idx"])
    sent, pre_read, end, last = defaultdict(set), set(), max(block), max(block.values())
    running, after = defaultdict(set), set()
    outside = {n["idx"]: n["target"] for n in plan.nodes if n.get("kind") == "param"}
    outside = {i: f for i, f in outside.items() if not str(f).startswith(prefix + ".")}
    for n in fw:
        mine = block.get(n["idx"])
        between = mine is None and start < n["idx"] < end  # after the first block's ops, before the last's
        if between and any(p in outside for p, _ in n.get("inputs", [])):  # PoolFormer's downsampling embeddings
            raise NotImplementedError(
                f"module '{n.get('module') or '<root>'}' holds parameters and runs between the blocks of '{prefix}' "
                f"(a layer list interleaved with other modules): the stages hold blocks and the modules before and "
                f"after them only (plan-only)"
            )
        for p, o in n.get("inputs", []):
            if mine is not None and p in outside:  # DeBERTa's relative position table, read by every layer
                raise NotImplementedError(
                    f"block '{prefix}.{mine}' reads parameter '{outside[p]}' of a module outside the blocks: "
                    f"the stages after the one holding it do not have it (plan-only)"
                )
            if p in block and block[p] != mine:
                sent[block[p]].add((p, o))
                if mine is None and n["idx"] > end and block[p] != last:  # read after the blocks: not the last's
                    after.add((block[p], (p, o)))
                elif mine == block[p] + 1:
                    running[block[p]].add((p, o))
            elif p < start and p not in block and p in from_params and p not in params and n["idx"] > start:
                pre_read.add((p, o) if mine == first else (p, o, "elsewhere"))
    sends_sides = plan.meta.get("keyword_inputs")  # side_values.py
    for b, v in after:  # a running tensor, or (chained stages) any block output, read after the last block
        if not sends_sides or v in running[b]:
            raise NotImplementedError(
                f"block '{prefix}.{b}''s output is read after the last block (every block's hidden state "
                f"collected, a multi-scale head): later stages do not have it (plan-only)"
            )
    for b, vals in sent.items():
        if len(vals) > 1 and not sends_sides:
            raise NotImplementedError(
                f"block '{prefix}.{b}' hands {len(vals)} values to what follows it (its running tensor and e.g. an "
                f"MoE router's logits for an aux loss): a pipeline stage boundary carries one tensor (plan-only)"
            )
    if not sends_sides and (len({v[:2] for v in pre_read}) > 1 or any(len(v) == 3 for v in pre_read)):
        raise NotImplementedError(
            f"values made from parameters before '{prefix}' are read beyond the first block's running tensor "
            f"(e.g. embeddings fed to every block or to the head): the chained stages do not have them; plan with "
            f"example_kwargs= (the model's inputs by name) and run runner.step_model, whose stages send them on"
        )


def check_chain(plan) -> None:
    """Refuse, naming the op and its module, a positional plan (the runtime chains the stages' modules) whose
    forward computes on the running tensor outside those modules before the last of them: the chain would skip it
    (a mean pool between the encoder and the head, a scaling of the embedding). What follows the last module is the
    loss, which loss_fn computes; values that depend on no input (RoPE tables) are handed to the blocks."""
    listed = [f for st in plan.stages for f in st["modules"]]
    inside = lambda m: any(m == f or m.startswith(f + ".") for f in listed)
    fw = [n for n in plan.nodes if n.get("kind") == "op" and n.get("phase") == "fw"]
    fed = {n["idx"] for n in plan.nodes if n.get("kind") == "input"}
    for n in fw:
        if any(p in fed for p, _ in n.get("inputs", [])):
            fed.add(n["idx"])
    feeds, users = set(), defaultdict(list)
    for n in fw:
        for p, _ in n.get("inputs", []):
            users[p].append(n)
    for n in reversed(fw):
        if any(inside(u.get("module") or "") or u["idx"] in feeds for u in users[n["idx"]]):
            feeds.add(n["idx"])
    for n in fw:
        if n["idx"] in fed and n["idx"] in feeds and not inside(n.get("module") or ""):
            where = f"module '{n['module']}'" if n.get("module") else "the model's own forward"
            raise NotImplementedError(
                f"op {n['target']} in {where} computes on the running tensor outside the stages' modules "
                f"{listed[0]} .. {listed[-1]}: the pipeline runtime chains those modules and would skip it; plan with "
                f"example_kwargs= (the model's inputs by name) and run runner.step_model, which runs the model's "
                f"own forward"
            )


def unlisted(model: nn.Module, plan) -> list[str]:
    """The top-most modules holding parameters that no stage lists, none of them a listed module's tensor: their
    ops never reach the loss (the plan's graph has none: FNet's and BigBird's poolers under a masked-LM head), so a
    stage runs them as stand-ins returning zeros (build)."""
    listed = [f for st in plan.stages for f in st["modules"]]
    near = lambda f: any(f == m or f.startswith(m + ".") or m.startswith(f + ".") for m in listed)
    held = {id(p) for f in listed for p in model.get_submodule(f).parameters()}
    out = []
    for f, mod in model.named_modules():
        if not f or near(f) or any(f.startswith(u + ".") for u in out):
            continue
        params = list(mod.parameters())
        if params and not any(id(p) in held for p in params):
            out.append(f)
    return out


def probe(model: nn.Module, prefix: str, outer: list, call: dict, unused: tuple = ()) -> dict:
    """One forward of `model(**call)` (a micro-batch), no gradients, the RNG state kept: per block FQN how its
    output holds the running tensor (None: it is the output; n: a tuple of n, it first, the rest None); per module
    of `outer` (the plan's modules outside the blocks) holding parameters that runs before the first block
    ("outputs"), per module of `unused` (see `unlisted`) that runs, and per module of `outer` whose output later
    stages read ("sides", side_values.Tracker), its output as side_values.probed gives it (tree spec, leaves). A
    block that runs twice (a shared layer) or a block output the forward edits before the next block is refused."""
    layers = model.get_submodule(prefix)
    blocks = [f"{prefix}.{n}" for n, _ in layers.named_children()]
    seen: dict = {"blocks": {}, "outputs": {}, "unused": {}}

    def block_hook(fqn):
        def hook(mod, args, kwargs, out):
            if _hidden_of(args, kwargs) is None:
                raise NotImplementedError(
                    f"block '{fqn}' takes no running tensor as its first argument or hidden_states=: the pipeline "
                    f"runtime cannot hand it a received activation"
                )
            if fqn in seen["blocks"]:
                raise NotImplementedError(
                    f"block '{fqn}' runs more than once in one forward (ALBERT's shared layer): a pipeline stage "
                    f"holds each block once (plan-only)"
                )
            rest = tuple(_stand_in_value(o) for o in out[1:]) if isinstance(out, (tuple, list)) and out else None
            if isinstance(out, torch.Tensor):
                seen["blocks"][fqn] = None
            elif rest is not None and isinstance(out[0], torch.Tensor) and _NOT_HANDED not in rest:
                seen["blocks"][fqn] = (type(out), rest)
            else:
                kinds = [type(o).__name__ for o in (out if isinstance(out, tuple) else (out,))]
                raise NotImplementedError(
                    f"block '{fqn}' returns {type(out).__name__} ({', '.join(kinds)}): the pipeline runtime hands on "
                    f"a block's running tensor, first in a tuple or list of tensors, None or shape values"
                )

        return hook

    def unused_hook(fqn):
        def hook(mod, args, out):
            seen["unused"][fqn] = side_values.probed(out)

        return hook

    handles = [model.get_submodule(f).register_forward_hook(block_hook(f), with_kwargs=True) for f in blocks]
    handles += [model.get_submodule(f).register_forward_hook(unused_hook(f)) for f in unused]
    tracker = side_values.Tracker(model, outer, blocks, _hidden_of)
    try:  # the whole forward: a block it runs twice (a shared layer) must be seen
        with torch.no_grad(), torch.random.fork_rng(devices=[]), tracker:
            model(**call)
    finally:
        tracker.close()
        for h in handles:
            h.remove()
    seen["outputs"], seen["sides"], seen["aliases"] = tracker.made, tracker.sides, tracker.aliases
    if tracker.between:
        raise NotImplementedError(
            f"the forward computes on block '{tracker.between}''s output before the next block takes it (e.g. a "
            f"residual added outside the blocks of '{prefix}'): a pipeline stage hands a block's output on as it is"
        )
    if tracker.escaped:
        raise NotImplementedError(
            f"a value made inside block '{tracker.escaped}' is read after it other than through the block's output "
            f"(a forward hook keeping it, as transformers' output recorders keep MoE router logits): a stage "
            f"standing in for the block does not make it"
        )
    if len(seen["blocks"]) != len(blocks):
        raise ValueError(f"the model's forward ran {len(seen['blocks'])} of the {len(blocks)} blocks of '{prefix}'")
    return seen


def _shallow(mod: nn.Module) -> nn.Module:
    """A copy of `mod` sharing its parameters, buffers and attributes, with its own child and hook tables (made
    without copy.copy: a parametrized module refuses to be pickled, Wav2Vec2's weight-normed positional conv)."""
    c = object.__new__(type(mod))
    c.__dict__.update(vars(mod))
    for k, v in list(vars(mod).items()):
        if k.startswith("_") and isinstance(v, dict):
            setattr(c, k, type(v)(v))
    return c


def build(model: nn.Module, plan, k: int, seen: dict, holder: dict) -> nn.Module:
    """Stage k's skeleton (see the module docstring); holder["recv"] is where its forward puts the received
    activation for its first block."""
    st, prefix = plan.stages[k], plan.schedule["layer_prefix"]
    mine = list(st["modules"])
    blocks = [f for f in mine if f.startswith(prefix + ".")]
    others = {f: j for j, s in enumerate(plan.stages) if j != k for f in s["modules"]}
    first_stage, last_stage = k == 0, k == len(plan.stages) - 1
    order = [f"{prefix}.{n}" for n, _ in model.get_submodule(prefix).named_children()]
    # a stage without blocks: the embedding alone (ends where block 0 starts) or the head alone (takes the
    # activation where the last block ends)
    end_at = order[0] if not blocks and not last_stage else None
    recv_at = order[-1] if not blocks and not first_stage else None
    root, sides = _shallow(model), seen["sides"]
    side_values.check(sides)
    for f in (f for f in sides if f in mine):  # a module's output sent on with the running tensor
        mod = _shallow(model.get_submodule(f))
        mod.forward = types.MethodType(side_values.capture(type(mod).forward, f, holder), mod)
        _replace(root, f, mod)
    for f, j in others.items():
        new = None if f in mine else _stand_in(model, f, j > k, prefix, seen, holder, (f == recv_at, f == end_at))
        if new is not None:
            _replace(root, f, new)
    for f, out in seen["unused"].items():
        if {f"{f}.{n}" for n, _ in model.get_submodule(f).named_parameters()} <= set(st["params"]):
            continue  # this stage holds them (the planner puts unused parameters somewhere)
        if not all(_tensor_or_shape(v) for v in out[1]):
            raise NotImplementedError(
                f"module '{f}' runs in the forward, its output never reaching the loss, and returns "
                f"{_kinds(out[1])} besides tensors and shape values: a stage cannot stand in for it (no stage holds "
                f"its parameters)"
            )
        _replace(root, f, _ghost(model.get_submodule(f), _zeros(out)))
    recompute = int(st.get("recompute_blocks", 0))
    makes = {key.rpartition(":")[0] for key in sides}
    for i, f in enumerate(blocks):
        inject, end = i == 0 and not first_stage, i == len(blocks) - 1 and not last_stage
        if inject or end or i < recompute or f in makes:
            _replace(root, f, _block(model.get_submodule(f), f, inject, end, i < recompute, holder, sides))
    _strip_others(root, set(st["params"]), {f for s in plan.stages for f in s["modules"]})
    owner = {f: j for j, s in enumerate(plan.stages) for f in s["modules"]}
    route = side_values.routes(sides, owner, k, last_stage)
    root.forward = types.MethodType(_stage_forward(holder, sides, route, last_stage), root)
    have = {n for n, _ in root.named_parameters()}
    if have != set(st["params"]):
        raise ValueError(f"stage {k}: skeleton holds parameters {sorted(have ^ set(st['params']))[:6]} unlike the plan")
    return root


def _stand_in(model, f: str, later: bool, prefix: str, seen: dict, holder: dict, ends: tuple):
    """The stand-in for module `f` of another stage (`later`: of a stage after this one), or None where this
    stage runs it as it is (parameter-free: RoPE tables). ends: (f takes the received activation, f ends the
    stage's forward), for a stage that holds no block."""
    old = model.get_submodule(f)
    if f in seen["sides"]:  # made on an earlier stage, received
        return _ghost(old, side_values.stand_in(seen["sides"][f], f, holder))
    if f.startswith(prefix + "."):
        return _ghost(old, _skip(f, seen["blocks"].get(f), holder, seen, *ends))
    if not any(True for _ in old.parameters()):
        return None
    if later:  # after the blocks (the last stage's)
        return _ghost(old, _unreached(f))
    made = seen["outputs"].get(f)
    if made is not None and all(_tensor_or_shape(v) for v in made[1]):  # before the blocks
        return _ghost(old, _zeros(made))
    raise NotImplementedError(
        f"module '{f}' runs before the blocks on another stage and returns "
        f"{_kinds(made[1]) if made is not None else 'nothing the probe saw'}, not only tensors and shape values: "
        f"a later stage cannot stand in for it"
    )


def _strip_others(root: nn.Module, want: set, listed: set) -> None:
    """Parameters under a name the stage does not hold, of a module no stage lists (BART's `shared` embedding,
    whose tensor its encoder and decoder embeddings use, on the decoder's stage): kept as meta tensors that are no
    parameters, as in `_ghost`; the stage holds the tensor under its own module's name."""
    inside = lambda owner: any(owner == m or owner.startswith(m + ".") for m in listed)
    for n, p in list(root.named_parameters(remove_duplicate=False)):
        owner, _, attr = n.rpartition(".")
        if n in want or inside(owner):
            continue
        mod = _shallow(root.get_submodule(owner)) if owner else root
        del mod._parameters[attr]
        object.__setattr__(mod, attr, p.detach().to("meta"))
        if owner:
            _replace(root, owner, mod)


def _replace(root: nn.Module, fqn: str, new: nn.Module) -> None:
    """Put `new` at `fqn` in root's tree, shallow-copying the containers on the way (the model keeps its own)."""
    parts = fqn.split(".")
    cur = root
    for p in parts[:-1]:
        child = cur._modules[p]
        if not getattr(child, "_autopar_skeleton", False):
            child = _shallow(child)
            child._autopar_skeleton = True
            cur._modules[p] = child
        cur = child
    cur._modules[parts[-1]] = new


def _block(block: nn.Module, fqn: str, inject: bool, end: bool, recompute: bool, holder: dict, sides) -> nn.Module:
    """A shallow copy of `block` whose forward takes the received activation (inject), ends the stage's forward
    with its running tensor (end), or is checkpointed (recompute), keeping its side outputs to send."""
    c = _shallow(block)
    run = type(block).forward

    def forward(self, *args, **kwargs):
        if inject:
            if args and isinstance(args[0], torch.Tensor):
                args = (holder["recv"],) + tuple(args[1:])
            else:
                kwargs = {**kwargs, "hidden_states": holder["recv"]}
        if recompute:
            from torch.utils.checkpoint import checkpoint

            out = checkpoint(run, self, *args, use_reentrant=False, **kwargs)
        else:
            out = run(self, *args, **kwargs)
        side_values.keep(fqn, out, sides, holder)
        if end:
            raise _StageEnd(out if isinstance(out, torch.Tensor) else out[0])
        return out

    c.forward = types.MethodType(forward, c)
    return c


def _contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    """The received activation, its gradient made contiguous (sent back as it is; a channels-last block gives a
    channels-last gradient, which gloo and NCCL do not send). Once per buffer: torch's stage reuses them."""
    if x.requires_grad and not getattr(x, "_autopar_contiguous_grad", False):
        x.register_hook(lambda g: None if g is None else g.contiguous())
        x._autopar_contiguous_grad = True
    return x


def _stage_forward(holder: dict, sides: dict, route: tuple, last: bool):
    def forward(self, *recv, **call):
        holder["recv"] = _contiguous_grad(recv[0]) if recv else None
        holder["got"] = side_values.receive(sides, route[0], recv[1:], _contiguous_grad)
        holder["made"] = {}
        counter = batch_split.LossCount()
        try:
            with counter if last else contextlib.nullcontext():
                out = type(self).forward(self, **call)
        except _StageEnd as e:
            hidden = e.hidden.contiguous()  # sent as it is (gloo and NCCL send contiguous buffers)
            return (hidden, *side_values.outgoing(route[1], holder)) if route[1] else hidden
        except StopIteration as e:  # next() over an empty iterator, which would end the schedule's own loops
            raise RuntimeError(
                f"{type(self).__name__}'s forward on a pipeline stage raised StopIteration, as `next(m.parameters())`"
                f" does (transformers' `self.dtype`) on a module whose parameters are all on other stages"
            ) from e
        finally:
            holder["recv"] = holder["got"] = holder["made"] = None
        if not last:
            raise RuntimeError("a pipeline stage before the last ran the model's forward to its end")
        holder["counts"].append(counter.count())
        # shape [1]: the schedule concatenates the last stage's outputs over micro-batches
        return torch.stack([pick_loss(out, None, type(self).__name__)[0]])  # no view: split backward detaches it

    return forward


def step(runner, args: tuple, kwargs: dict):
    """PipelineRunner.step_model: the call bound to the model's signature and passed as keyword arguments to every
    stage (the schedule splits its batched tensors into micro-batches); the stages are built at the first step, from
    a probe of its first micro-batch."""
    sig = inspect.signature(runner._model.forward)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values()):
        raise NotImplementedError(f"{type(runner._model).__name__}.forward takes *args: pass keyword inputs")
    call = dict(sig.bind(*args, **kwargs).arguments)
    leaves = [v for v in call.values() if isinstance(v, torch.Tensor)]
    runner._agree(leaves)
    plan = runner.plan
    m = plan.schedule["n_microbatches"]
    if runner.schedule is None:
        rows = leaves[0].shape[0]
        batched = lambda v: isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows
        first = {n: v.tensor_split(m)[0] if batched(v) else v for n, v in call.items()}
        prefix = plan.schedule["layer_prefix"]
        outer = [f for st in plan.stages for f in st["modules"] if not f.startswith(prefix + ".")]
        seen = probe(runner._model, prefix, outer, first, tuple(unlisted(runner._model, plan)))
        if batch_split.is_split(plan):
            why = batch_split.loss_rows_error(runner._model, call, m)
            runner.refuse_together(
                NotImplementedError(why) if why else None,
                lambda: NotImplementedError(
                    "the model's loss does not split over micro-batches (said on another rank)"
                ),
            )
        runner._build(lambda k: build(runner._model, plan, k, seen, {"counts": runner.counts}), scale_grads=False)
    losses = [] if runner.is_last else None
    kw = {"target": torch.zeros(m), "losses": losses} if runner.is_last else {}
    runner.counts.clear()
    runner.schedule.step(**kw, **call, **no_outputs(runner.schedule))
    mine = _to_batch_mean(runner)
    runner.tied.sum(runner.named_parameters())
    return torch.stack([loss.detach() for loss in losses]).sum() / mine if runner.is_last else None


def no_outputs(schedule) -> dict:
    """step()'s option not to keep each micro-batch's output on the last stage: torch's schedules return the
    merged outputs by default, so the last stage would hold every micro-batch's logits from its forward to the next
    step (m logits tensors through the backward and the optimizer step); the runner returns the losses only. Older
    torch (before `return_outputs`) has no such option."""
    return {"return_outputs": False} if "return_outputs" in inspect.signature(schedule.step).parameters else {}


def loss_of_microbatch(runner):
    """The schedule's loss_fn for the model's own loss (shape [1]): its sum over the micro-batch's counted targets
    (`batch_split.LossCount`), or the loss itself where the count is not known (each micro-batch then weighs the same)."""

    def loss_fn(out, _target):
        c = runner.counts[-1]
        return out.sum() * (c.to(out.dtype) if c is not None else 1.0)

    return loss_fn


def _to_batch_mean(runner) -> torch.Tensor:
    """Divide every local gradient by the batch's count of targets (over the micro-batches of every data-parallel
    rank; DDP / FSDP2 averaged them over those ranks already, so times their number), as one device's mean over
    the batch; returns this rank's count (its rows' mean is the sum of its micro-batch sums over it)."""
    import torch.distributed as dist

    plan, mesh = runner.plan, runner.mesh
    m = plan.schedule["n_microbatches"]
    counts = runner.counts[-m:]  # the step's micro-batches (the first step's shape inference ran a forward before)
    known = runner.is_last and all(c is not None for c in counts)
    mine = sum(counts) if known else float(m)
    total = torch.tensor([float(mine) if runner.is_last else 0.0], dtype=torch.float64)
    dist.all_reduce(total, group=mesh.get_group("pp"))  # the last stage's count, on every stage of this pipeline
    mine = float(total)
    dims = runner.batch_dims()
    ranks = 1
    for nm in dims:
        dist.all_reduce(total, group=mesh.get_group(nm))
        ranks *= mesh.size(mesh.mesh_dim_names.index(nm))
    scale = ranks / float(total)
    with torch.no_grad():
        for _, p in runner.named_parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return torch.tensor(mine)
