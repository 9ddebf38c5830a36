"""autopar's own placement rules, by op: `@rule(op, ...)` registers a function (args, kwargs, input metas) -> the
per-mesh-dim strategies of those ops (see autopar/strategies/__init__.py for how they are written and expanded).
The rule modules (this package's __init__, grouped_mm.py) register into RULES at import."""

from __future__ import annotations

from typing import Callable

RULES: dict[object, Callable] = {}


def rule(*ops):
    def deco(fn):
        for op in ops:
            RULES[op] = fn
        return fn

    return deco
