"""A user's model for `autopar plan --model package.module:factory` (or path/to/file.py:factory).

The factory is called with no arguments and returns (model, example_inputs) or (model, args, kwargs):
example_inputs is a tuple of positional inputs, one tensor, or a dict of keyword inputs (autopar.plan's contract).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def from_factory(spec: str, error=ValueError):
    """(model, example inputs, example kwargs) from the factory `spec` names; `error` is raised, with a one-line
    message, when the spec, the import or the factory's result is wrong (the factory's own exceptions pass)."""
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise error(f"--model {spec!r} must look like package.module:factory or path/to/file.py:factory")
    module = _import(where, spec, error)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise error(f"--model {spec!r}: {where} has no function {name!r}")
    return _unpack(factory(), spec, error)


def _import(where: str, spec: str, error):
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise error(f"--model {spec!r}: no file {where}")
        mod_spec = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], where)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:  # the `autopar` script's path holds the script's dir
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name and where.startswith(e.name):
            raise error(
                f"--model {spec!r}: no module named {e.name!r} (run from its directory or install it)"
            ) from None
        raise


def _unpack(result, spec: str, error):
    import torch
    from torch import nn

    shape = "(model, example_inputs) or (model, args, kwargs)"
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise error(f"--model {spec!r}: the factory returned {type(result).__name__}; it must return {shape}")
    model, inputs, *rest = result
    if not isinstance(model, nn.Module):
        raise error(f"--model {spec!r}: the factory's first value is a {type(model).__name__}, not an nn.Module")
    kwargs = rest[0] if rest else None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise error(f"--model {spec!r}: the factory's third value (kwargs) is a {type(kwargs).__name__}, not a dict")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    elif isinstance(inputs, list):
        inputs = tuple(inputs)
    elif not isinstance(inputs, (tuple, dict)):
        raise error(f"--model {spec!r}: example inputs are a {type(inputs).__name__}; give a tuple, tensor or dict")
    return model, inputs, kwargs
