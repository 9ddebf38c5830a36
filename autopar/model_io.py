"""The model contract: how a model is called (positional and keyword inputs) and where its loss is.

`ModelIO.from_example(model, example_inputs, example_kwargs)` binds the example call to the model's forward
signature (so `model(ids, labels=y)` and `model(input_ids=ids, labels=y)` are the same call) and flattens the bound
arguments with torch's pytree into leaves: the tensor leaves are the graph's inputs; every other leaf (use_cache=True,
None, an int) is a constant of the capture, which a later call must repeat (`flatten_call` says which argument
differs otherwise). `pick_loss` finds the loss in what the model returns (a tensor, `out.loss` of a transformers
ModelOutput, `out["loss"]` of a dict, `out[0]` of a tuple, or `loss_fn(out)`); `wrap_loss` gives a parallel module's
result back in the same kind of container with only the loss set, so `pm(**batch).loss` works as on the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
import torch.nn as nn
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

_VAR = "*args"


def _signature(model: nn.Module):
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def _name(path) -> str:
    """A readable argument path: input_ids, labels, args[1], pixel_values[0]['x']."""
    s = keystr(path)
    if s.startswith("['") and "']" in s:
        head, rest = s[2:].split("']", 1)
        return head + rest
    return s


class ModelIO:
    """A model's example call, bound to its signature and flattened (see the module docstring)."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict):
        self.model_name = type(model).__name__
        self.sig = _signature(model)
        arguments = self._bind(args, kwargs)
        self.leaves, self.spec, self.names = self._flatten(arguments)
        self.tensor_leaves = [i for i, x in enumerate(self.leaves) if isinstance(x, torch.Tensor)]
        self.out_kind = None  # set by pick_loss on the captured output

    @classmethod
    def from_example(cls, model, example_inputs, example_kwargs=None) -> "ModelIO":
        """Check the arguments of plan/parallelize before anything runs, naming the one at fault."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
            raise TypeError(f"example_kwargs must be a dict of keyword inputs, got {type(example_kwargs).__name__}")
        if example_inputs is None and not example_kwargs:
            raise TypeError(
                f"example_inputs is None: pass one step's global inputs of {type(model).__name__} as a "
                f"tuple (positional), a dict (keyword inputs) or example_kwargs={{...}}"
            )
        if isinstance(example_inputs, Mapping):
            if example_kwargs:
                raise TypeError(
                    "example_inputs is a dict (keyword inputs) and example_kwargs is given too: pass "
                    "the keyword inputs once"
                )
            args, kwargs = (), dict(example_inputs)
        elif example_inputs is None:
            args, kwargs = (), dict(example_kwargs)
        else:
            args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
            kwargs = dict(example_kwargs or {})
        for k in kwargs:
            if not isinstance(k, str):
                raise TypeError(f"keyword input names must be strings, got {k!r}")
        io = cls(model, args, kwargs)
        for i, x in enumerate(io.leaves):
            if type(x).__module__ == "numpy" and hasattr(x, "shape"):
                raise TypeError(
                    f"input '{io.names[i]}' of {io.model_name} is a numpy array: pass a torch.Tensor "
                    f"(torch.as_tensor(...))"
                )
        if not io.tensor_leaves:
            raise TypeError(
                f"the example inputs of {io.model_name} hold no tensor (got {io.describe()}); pass the "
                f"step's input tensors"
            )
        return io

    def _bind(self, args: tuple, kwargs: dict) -> dict:
        """{parameter name: value} in signature order; a **kwargs parameter's dict sorted by name, so the order
        keywords are written in does not matter."""
        if self.sig is None:
            return {_VAR: tuple(args), **{k: kwargs[k] for k in sorted(kwargs)}}
        try:
            bound = self.sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"the inputs do not fit {self.model_name}.forward{self.sig}: {e}") from None
        out = {}
        for name, v in bound.arguments.items():
            kind = self.sig.parameters[name].kind
            out[name] = {k: v[k] for k in sorted(v)} if kind is inspect.Parameter.VAR_KEYWORD else v
        return out

    @staticmethod
    def _flatten(arguments: dict):
        pairs, spec = tree_flatten_with_path(arguments)
        return [v for _, v in pairs], spec, [_name(p) for p, _ in pairs]

    def describe(self) -> str:
        return ", ".join(f"{n}={type(x).__name__}" for n, x in zip(self.names, self.leaves)) or "nothing"

    def call_args(self, leaves: list) -> tuple[tuple, dict]:
        """(args, kwargs) to call the model with, from leaves in the example's layout."""
        arguments = tree_unflatten(list(leaves), self.spec)
        if self.sig is None:
            return tuple(arguments.pop(_VAR)), arguments
        bound = inspect.BoundArguments(self.sig, arguments)
        return bound.args, bound.kwargs

    def flatten_call(self, args: tuple, kwargs: dict) -> list:
        """The leaves of a later call, checked against the example's: the same arguments given, the same
        non-tensor values (they are constants of the captured graph), a tensor wherever the example had one."""
        arguments = self._bind(args, kwargs)
        leaves, spec, names = self._flatten(arguments)
        if spec != self.spec:
            self._explain(arguments)
        for i, (x, ex) in enumerate(zip(leaves, self.leaves)):
            if isinstance(ex, torch.Tensor):
                if not isinstance(x, torch.Tensor):
                    raise TypeError(
                        f"input '{self.names[i]}' must be a tensor like the example input, got {type(x).__name__}"
                    )
            elif not _same_constant(x, ex):
                raise ValueError(
                    f"input '{self.names[i]}' is {x!r} but the plan was captured with {ex!r}; "
                    f"non-tensor inputs are constants of the plan: plan again for other values"
                )
        return leaves

    def _explain(self, arguments: dict):
        """Say which argument of a call differs from the example's in what is given or in structure."""
        example = tree_unflatten(list(self.leaves), self.spec)
        diff = sorted(set(arguments) ^ set(example))
        if diff:
            raise TypeError(
                f"the call passes other arguments than the example inputs the plan was captured with: "
                f"{', '.join(diff)} (example: {', '.join(example)}); pass the same arguments"
            )
        for k, v in arguments.items():
            if isinstance(example[k], torch.Tensor) and not isinstance(v, torch.Tensor):
                raise TypeError(f"input '{k}' must be a tensor like the example input, got {type(v).__name__}")
            if self._flatten({k: v})[1] != self._flatten({k: example[k]})[1]:
                raise TypeError(
                    f"input '{k}' has another structure than in the example inputs: "
                    f"{type(v).__name__} where the example had {type(example[k]).__name__}"
                )
        raise TypeError("the call's inputs have another structure than the example inputs")

    def wrap_loss(self, loss: torch.Tensor):
        """The module's result: the loss in the container kind the model returned (only the loss set)."""
        kind = self.out_kind
        if kind is None or kind == "tensor":
            return loss
        if kind == "dict":
            return {"loss": loss}
        if kind == "tuple":
            return (loss,)
        return kind(loss=loss)  # a ModelOutput class


def _same_constant(x, ex) -> bool:
    if x is ex:
        return True
    if type(x) is not type(ex):
        return False
    try:
        return bool(x == ex)
    except Exception:  # objects with no meaningful equality (a cache object): only the same one
        return False


def pick_loss(out, loss_fn=None, model_name: str = "the model"):
    """(the loss tensor, the output kind wrap_loss rebuilds): loss_fn(out) when given, else the output itself (a
    tensor), `out.loss` (a ModelOutput or any mapping with a loss), `out["loss"]` (a dict) or `out[0]` (a tuple)."""
    if loss_fn is not None:
        return loss_fn(out), "tensor"
    if isinstance(out, torch.Tensor):
        return out, "tensor"
    if isinstance(out, Mapping):
        if "loss" not in out or out["loss"] is None:
            keys = [k for k, v in out.items() if v is not None]
            raise TypeError(
                f"{model_name} returned a {type(out).__name__} without a loss (fields: {keys}); pass "
                f"the labels among the inputs (e.g. labels=...) or loss_fn=..."
            )
        kind = "dict" if type(out) is dict else type(out)
        if kind != "dict" and not _rebuilds(kind):
            kind = "dict"
        return out["loss"], kind
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0], "tuple"
    raise TypeError(
        f"{model_name} returned {type(out).__name__}: expected a loss tensor, a ModelOutput/dict with "
        f"a 'loss', or a tuple whose first item is the loss; or pass loss_fn=..."
    )


def _rebuilds(cls) -> bool:
    """Whether cls(loss=...) makes a container with that loss (transformers' ModelOutput dataclasses do)."""
    try:
        return cls(loss=torch.zeros(())).get("loss") is not None
    except Exception:
        return False
