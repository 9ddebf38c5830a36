"""The autopar command line: `autopar plan | explain | diff | report` (also `python -m autopar ...`).

Only argparse is imported up front: torch and the planner are imported inside the command functions, so `--help`
answers at once. A bad argument or a failed command is one line on stderr (exit 2 for usage errors, 1 for a
command that failed); `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys

DTYPES = ("bf16", "fp32")
PROG = "autopar"


class UsageError(Exception):
    """A bad argument found after parsing (exit 2, like argparse's own)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv=()) -> argparse.ArgumentParser:
    ap = _Parser(
        prog=PROG,
        description="Plan how to parallelize a PyTorch training step, and read the plans.",
        epilog="Run 'autopar COMMAND --help' for a command's flags. Docs: docs/cli.md",
    )
    ap.add_argument("--debug", action="store_true", help="show the full traceback when a command fails")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    _add_plan(sub)
    _add_explain(sub)
    _add_diff(sub)
    _add_report(sub, wanted=_subcommand(argv) == "report")
    return ap


def _subcommand(argv) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def _debug_flag(p) -> None:
    # SUPPRESS: a subcommand's default must not override `autopar --debug COMMAND`
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback on failure")


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="plan a zoo model or your own on a (simulated) mesh: print the summary, write the annotated graph",
        description="Plan one training step of a model on a device mesh you may not have (the plan is made on "
        "meta tensors; no GPU needed). Prints the plan's summary, writes the annotated graph (--dump) and "
        "optionally the plan as JSON (-o) for explain, diff, report and autopar.Plan.load.",
    )
    p.add_argument(
        "--model",
        default="llama3-8b",
        metavar="NAME|MODULE:FACTORY",
        help="a zoo model name (see --list-models; default llama3-8b) or your own model as package.module:factory "
        "or path/to/file.py:factory, where factory() returns (model, example_inputs) or (model, args, kwargs)",
    )
    p.add_argument("--list-models", action="store_true", help="print the zoo's model names, one line each, and exit")
    p.add_argument("--mesh", default="8x8", help="mesh shape, e.g. 8, 8x8, 2x4x8 (default 8x8)")
    p.add_argument(
        "--names", default=None, help="mesh dim names, comma-separated, e.g. dp,tp (default dp | dp,tp | pp,dp,tp)"
    )
    p.add_argument(
        "--cluster", default="h100", help="cost model: h100 | a100 | h200 | cpu-gloo | path to a cluster JSON"
    )
    p.add_argument(
        "--batch", type=_positive(int), default=None, help="global batch size (zoo models; default: the model's)"
    )
    p.add_argument(
        "--seq", type=_positive(int), default=None, help="sequence length (zoo models; default: the model's)"
    )
    p.add_argument("--layers", type=_positive(int), default=None, help="override the number of layers (zoo models)")
    p.add_argument(
        "--dtype", default=None, help="bf16 | fp32: the model's parameter dtype (default: bf16 for llama3-*, else fp32)"
    )
    p.add_argument(
        "--memory-gb",
        type=_positive(float),
        default=None,
        help="memory budget per rank in GB (default: 90%% of the device's)",
    )
    p.add_argument(
        "--force",
        action="append",
        default=[],
        metavar="PARAMS=PLACEMENTS",
        help="pin parameters: an FQN or glob and one placement per mesh dim, e.g. 'layers.*.wq.weight=R,S0' "
        "(repeatable; e.g. to plan a hand layout and diff it against autopar's)",
    )
    p.add_argument("--dump", default=None, help="write the annotated graph here (default: <model>_<mesh>.dump.txt)")
    p.add_argument("-o", "--out", default=None, metavar="PLAN.json", help="save the plan as JSON")
    p.add_argument("--json", default=None, metavar="PLAN.json", help=argparse.SUPPRESS)  # the old name of --out
    _debug_flag(p)
    p.set_defaults(func=cmd_plan)


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive {'integer' if kind is int else 'number'}")
        return value

    return parse


def _add_explain(sub) -> None:
    p = sub.add_parser(
        "explain",
        help="why each placement: the chosen candidate, the runner-up and its cost difference",
        description="For each decision of a saved plan (a group of nodes the solver decides together), the chosen "
        "placement with its local cost (compute + comm, the rest of the plan fixed) against the runner-up's.",
    )
    p.add_argument("plan", metavar="PLAN.json", help="a plan saved by 'autopar plan -o' or Plan.save")
    p.add_argument("--module", default=None, metavar="M", help="only the nodes of module M and its submodules")
    p.add_argument("--nodes", action="store_true", help="one line per node (placement, the decision it follows)")
    p.add_argument(
        "--closest",
        type=_positive(int),
        default=None,
        metavar="N",
        help="only the N decisions whose runner-up comes nearest in cost (the close calls), nearest first",
    )
    _debug_flag(p)
    p.set_defaults(func=cmd_explain)


def _add_diff(sub) -> None:
    p = sub.add_parser(
        "diff",
        help="two plans side by side: placements, collectives, predicted time and memory",
        description="Compare two saved plans (e.g. autopar's plan and a hand plan made with 'autopar plan "
        "--force'): predicted step time and its parts, memory, collectives per kind and mesh dim, parameter "
        "placements that differ, and the nodes placed differently per module.",
    )
    p.add_argument("a", metavar="A.json", help="the first plan")
    p.add_argument("b", metavar="B.json", help="the second plan")
    p.add_argument("--nodes", action="store_true", help="list every node placed differently, not only per module")
    _debug_flag(p)
    p.set_defaults(func=cmd_diff)


def _add_report(sub, wanted: bool) -> None:
    """autopar/report.py defines the report's flags; it is imported only when the command is `report`."""
    kw = dict(help="write an HTML report of a saved plan (placements, cost breakdown, pipeline timeline)")
    p = sub.add_parser("report", description=kw["help"], **kw)
    _debug_flag(p)
    report = _report_module() if wanted else None
    if report is None:
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(func=cmd_report)
        return
    report.add_arguments(p)
    p.set_defaults(func=report.main)


def _report_module():
    import importlib.util

    if importlib.util.find_spec("autopar.report") is None:
        return None
    import autopar.report

    return autopar.report


def cmd_report(args) -> int:
    raise UsageError("the HTML report (autopar/report.py) is not part of this installation")


# ---- plan -----------------------------------------------------------------------------------------------------


def cmd_plan(args) -> int:
    if args.list_models:
        print(list_models())
        return 0
    from autopar.mesh import MeshSpec

    mesh = _parse(lambda: MeshSpec.parse(args.mesh, args.names), "--mesh/--names")
    dtype = _check_dtype(args.dtype)
    cluster = _check_cluster(args.cluster)
    model, inputs, kwargs, label = load_model(args, dtype)
    force = expand_force(args.force, model, mesh)
    return _plan_and_write(args, model, inputs, kwargs, label, mesh, cluster, force)


def _plan_and_write(args, model, inputs, kwargs, label, mesh, cluster, force) -> int:
    import time

    import autopar

    budget = args.memory_gb * 1e9 if args.memory_gb else None
    t = time.perf_counter()
    pl = autopar.plan(model, mesh, inputs, example_kwargs=kwargs, cluster=cluster, memory_budget=budget, force=force)
    dt = time.perf_counter() - t
    print(pl.summary())
    shapes = [tuple(x.shape) for x in _tensors(inputs, kwargs)]
    print(
        f"\nplanned {label} ({_count(sum(p.numel() for p in model.parameters()))} params, inputs {shapes}) in {dt:.2f} s"
    )
    path = args.dump or f"{_file_stem(label)}_{args.mesh}.dump.txt"
    with open(path, "w") as f:
        f.write(pl.dump())
    print(f"annotated graph written to {path}")
    for out in {args.out, args.json} - {None}:
        pl.save(out)
        print(f"plan saved to {out}")
    return 0


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M" if n >= 1e5 else str(n)


def _tensors(inputs, kwargs) -> list:
    import torch

    values = list(inputs.values()) if isinstance(inputs, dict) else list(inputs or ())
    return [v for v in values + list((kwargs or {}).values()) if isinstance(v, torch.Tensor)]


def _file_stem(label: str) -> str:
    """A zoo name as it is; 'pkg.mod:build' -> 'mod_build', 'dir/file.py:build' -> 'file_build'."""
    if ":" not in label:
        return label
    where, _, name = label.rpartition(":")
    return f"{os.path.basename(where).removesuffix('.py').rsplit('.', 1)[-1]}_{name}"


def _parse(fn, flag: str):
    try:
        return fn()
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


def _check_dtype(name):
    if name is None:
        return None
    if name not in DTYPES:
        raise UsageError(f"--dtype {name!r} is not one of {', '.join(DTYPES)}")
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def _check_cluster(name: str):
    from autopar.cost import CLUSTERS, get_cluster

    try:
        return get_cluster(name)
    except (ValueError, OSError, KeyError, TypeError) as e:
        if os.path.exists(name):
            raise UsageError(f"--cluster {name!r}: not a cluster JSON ({e})") from None
        raise UsageError(f"--cluster {name!r} is not one of {', '.join(CLUSTERS)} or a cluster JSON file") from None


def list_models() -> str:
    from autopar import models

    rows = []
    for name, mc in models.CONFIGS.items():
        kw = mc.kwargs
        shape = ", ".join(
            f"{label} {kw[k]}"
            for k, label in (("dim", "dim"), ("n_layers", "layers"), ("n_experts", "experts"), ("image_size", "image"))
            if k in kw
        )
        inputs = f"batch {mc.batch}" + ("" if mc.family == "cnn" else f" x seq {mc.seq}")
        rows.append(f"{name:<14} {mc.family:<6} {shape}; {inputs}" + (f"; {mc.description}" if mc.description else ""))
    return "\n".join(rows)


def load_model(args, dtype):
    """(model, example inputs, example kwargs, label): a zoo model built on meta tensors, or the user's factory."""
    if ":" in args.model:
        from autopar.cli_model import from_factory

        for flag in ("batch", "seq", "layers"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag} applies to zoo models; your factory {args.model} makes its own inputs")
        model, inputs, kwargs = from_factory(args.model, UsageError)
        if dtype is not None:  # the parameters and the floating-point inputs, so that they still match
            model, inputs, kwargs = model.to(dtype=dtype), _cast(inputs, dtype), _cast(kwargs, dtype)
        return model, inputs, kwargs, args.model
    import torch

    from autopar import models

    if args.model not in models.CONFIGS:
        raise UsageError(_unknown_model(args.model, list(models.CONFIGS)))
    if dtype is None:
        dtype = torch.bfloat16 if args.model.startswith("llama3-") and args.model != "llama3-debug" else torch.float32
    over = {"n_layers": args.layers} if args.layers else {}
    model = models.build_model(args.model, device="meta", dtype=dtype, **over)
    inputs = models.example_inputs(args.model, batch=args.batch, seq=args.seq, device="meta", **over)
    return model, inputs, None, args.model


def _cast(values, dtype):
    import torch

    cast = lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    if isinstance(values, dict):
        return {k: cast(v) for k, v in values.items()}
    return tuple(cast(v) for v in values) if values is not None else None


def _unknown_model(name: str, known: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(close)}?" if close else f"; zoo models: {', '.join(known)}"
    return f"--model {name!r} is not a zoo model{hint} (or give your own as package.module:factory)"


def expand_force(specs: list[str], model, mesh) -> dict:
    """'PATTERN=P1,P2' flags -> {parameter FQN: placements}; a pattern matching no parameter is an error."""
    import fnmatch

    names = [n for n, _ in model.named_parameters()]
    force = {}
    for spec in specs:
        pattern, sep, placements = spec.partition("=")
        pl = tuple(p.strip() for p in placements.split(","))
        if not sep or not pattern or not all(pl):
            raise UsageError(f"--force {spec!r} must look like PARAMS=PLACEMENTS, e.g. 'layers.*.wq.weight=R,S0'")
        if len(pl) != mesh.ndim:
            raise UsageError(f"--force {spec!r} needs one placement per mesh dim {mesh.names}")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise UsageError(f"--force {spec!r} matches no parameter of the model")
        force.update(dict.fromkeys(hits, pl))
    return force


# ---- explain, diff --------------------------------------------------------------------------------------------


def _load_plan(path: str):
    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such file (save a plan with 'autopar plan -o {path}')")
    import json

    from autopar.plan import Plan

    try:
        return Plan.load(path)
    except (json.JSONDecodeError, TypeError, KeyError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: not a plan saved by autopar ({type(e).__name__}: {e})") from None


def cmd_explain(args) -> int:
    from autopar.explain import explain

    print(explain(_load_plan(args.plan), module=args.module, per_node=args.nodes, closest=args.closest))
    return 0


def cmd_diff(args) -> int:
    from autopar.plan_diff import diff

    print(diff(_load_plan(args.a), _load_plan(args.b), labels=(args.a, args.b), per_node=args.nodes))
    return 0


# ---- entry ----------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    prog = f"{PROG} {args.cmd}"
    try:
        return args.func(args)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader left (`autopar explain ... | head`): not an error
        sys.stderr.close()
        return 0
    except Exception as e:
        if args.debug:
            raise
        print(f"{prog}: error: {_one_line(e)} (--debug shows the traceback)", file=sys.stderr)
        return 1


def _one_line(e: Exception) -> str:
    text = str(e).strip() or "(no message)"
    return text if isinstance(e, (ValueError, TypeError)) else f"{type(e).__name__}: {text}"
