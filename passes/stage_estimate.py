"""Estimated stage costs: what lets the stage search price every (stage submesh, micro-batch size) key while
solving the intra-op problem of only a few of them (passes/stages.py `run`, issue 26 part 4).

A key's intra-op plan is a capture plus a MILP (a few CPU seconds each); a large flat rank set has tens of keys
(pp degrees x tp degrees x micro-batch counts). Keys whose stage submeshes agree on every non-dp dim (the tp
part, a "family") and whose per-rank micro-batch (micro-batch / dp) is equal run the same per-rank shapes: the same
per-op plan fits them, only the data-parallel terms differ (the gradient reductions and parameter gathers run
over another dp group, FSDP-sharded state is divided by another dp size). Within a family the per-rank compute
and activations also scale with the per-rank micro-batch (a kernel is at least as efficient on a larger batch, so a
scaled-down figure is optimistic on compute; the per-op plan itself is the source's, chosen for its own dp size, so
neither direction bounds the step), and a key that looks good gets solved exactly.

`representatives` picks the keys solved first (per family the smallest per-rank micro-batch);
`estimate` prices any other key from its family's nearest solved key at or above its per-rank micro-batch (else
the largest below).
The search then solves exactly, in order of estimated step time, every key whose best estimated configuration beats
the best exact one (passes/stages.py), so the chosen plan is always priced by an exact intra-op plan.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from autopar.cost import collective_time
from autopar.strategies.data_parallel import dp_dims

from .stage_search import dp_size

# Arrays that scale with the per-rank micro-batch (seconds or bytes per micro-batch); state and dp comm do not.
_PER_SAMPLE = ("F", "B", "W", "act", "xbytes", "save", "rtime", "peak", "idle")


def family(key) -> tuple:
    """The non-dp part of a key's stage submesh: (name, size) of each dim not named dp*."""
    smesh, _ = key
    return tuple((nm, s) for nm, s in zip(smesh.names, smesh.shape) if not nm.startswith("dp"))


def per_rank(key) -> int:
    smesh, mb = key
    return mb // dp_size(smesh)


def representatives(keys: list) -> list:
    """Per family the key with the smallest per-rank micro-batch (the first such in `keys`). Its larger siblings
    were solved up front too, but they are the costliest solves of a family (a 405B cp stage at 2-4 samples per
    rank: 40-100 CPU s against 20-50) and an estimate from above is no better a bound: the source's per-op plan
    is optimal for its own dp size and micro-batch, not the target's (B6.15: 2x8(cp,tp) at one sample priced from
    32x2x8 at two was 46% slow, from 16x2x8 at one 6%), so the refinement solves whichever looks good either way."""
    out = []
    for fam in dict.fromkeys(family(k) for k in keys):
        out.append(min((k for k in keys if family(k) == fam), key=per_rank))
    return out


def source_for(key, solved: dict):
    """The solved key an estimate of `key` scales from: same family, the smallest per-rank micro-batch at or
    above key's (else the largest below); None when its family has none solved."""
    same = [k for k, ops in solved.items() if family(k) == family(key) and ops.variants]
    if not same:
        return None
    above = [k for k in same if per_rank(k) >= per_rank(key)]
    if above:
        return min(above, key=lambda k: (per_rank(k), -dp_size(k[0])))
    return max(same, key=per_rank)


@dataclass
class EstimatedOps:
    """A key's intra-op plans priced from another key's (`source`): what the search reads (`variants`, `costs()`)
    without plans; passes/stages.py solves the key exactly before its plan can be chosen."""

    key: tuple
    source: tuple
    variants: list
    seconds: float = 0.0
    exact: bool = False

    def costs(self) -> list:
        return list(self.variants)


def _dp_link(cluster, smesh):
    d = next(iter(dp_dims(smesh.names, smesh.shape)), None)
    return d, (cluster.link_for(smesh.shape, d) if d is not None else None)


def _dp_seconds(coll: dict, n: int, link) -> float:
    """Seconds of a cluster's recorded dp-class collectives (kind -> [count, bytes]) on a dp group of n ranks."""
    if n <= 1 or link is None:
        return 0.0
    return sum(cnt * collective_time(kind, nbytes / cnt, n, link) for kind, (cnt, nbytes) in coll.items() if cnt)


def _scaled(cv, s: float, d_src: int, d_dst: int, links) -> object:
    """One variant's Costs moved to another per-rank micro-batch (factor s) and dp size (d_src -> d_dst)."""
    out = copy.copy(cv)
    for name in _PER_SAMPLE:
        if getattr(cv, name) is not None:
            setattr(out, name, np.asarray(getattr(cv, name), dtype=float) * s)
    sharded = getattr(cv, "state_dp", None)
    if sharded is not None:  # FSDP-sharded state divides by the dp size, the rest is per rank as it is
        out.state = cv.state - sharded + sharded * (d_src / d_dst)
        out.state_dp = sharded * (d_src / d_dst)
    (n_src, l_src), (n_dst, l_dst) = links
    dp = np.array(cv.dp, dtype=float)
    for c, coll in enumerate(getattr(cv, "coll", None) or []):
        t_src = _dp_seconds(coll.get("dp", {}), n_src, l_src)
        t_dst = _dp_seconds(coll.get("dp", {}), n_dst, l_dst)
        dp[c] = dp[c] * t_dst / t_src if t_src > 0 else t_dst
    out.dp = dp
    out.name = f"{cv.name} (estimated)"
    return out


def estimate(key, solved: dict, cluster) -> EstimatedOps | None:
    """`key`'s costs scaled from its family's nearest solved key (source_for); None if its family has none."""
    src = source_for(key, solved)
    if src is None:
        return None
    s = per_rank(key) / per_rank(src)
    d_src, d_dst = dp_size(src[0]), dp_size(key[0])
    (_, l_src), (_, l_dst) = _dp_link(cluster, src[0]), _dp_link(cluster, key[0])
    links = ((d_src, l_src), (d_dst, l_dst))
    variants = [_scaled(cv, s, d_src, d_dst, links) for cv in solved[src].costs()]
    return EstimatedOps(key, src, variants)
