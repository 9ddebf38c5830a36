"""Pins combined. A pin (autopar.plan's `pin=`; passes/candidates.py reads it) maps a graph node to {mesh dim (or
(mesh dim, output)): placement} or None; several sources pin one plan (the caller, a pipeline stage's runtime
needs, context parallelism's sequence split, a hand layout's parts), and each names the dims it decides."""

from __future__ import annotations


def overlay_pins(*pins):
    """One pin from `pins` (None entries skipped): per node, the union of what each names, a later pin winning on a
    key two of them name. None where no pin is given; the one pin itself where only one is."""
    pins = [p for p in pins if p is not None]
    if len(pins) < 2:
        return pins[0] if pins else None

    def pin(n):
        out = {}
        for p in pins:
            out.update(p(n) or {})
        return out or None

    return pin
