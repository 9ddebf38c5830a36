"""Mesh specs: the shape and dim names of a device mesh, real (`DeviceMesh`) or simulated (`MeshSpec`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class MeshSpec:
    shape: tuple[int, ...]
    names: tuple[str, ...] | None = None

    def __post_init__(self):
        shape = tuple(self.shape) if isinstance(self.shape, (tuple, list)) else (self.shape,)
        if not shape or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape):
            raise ValueError(f"MeshSpec shape must be a non-empty tuple of positive ints, got {self.shape!r}")
        names = self.names
        if names is None:
            names = (
                ("dp",)
                if len(shape) == 1
                else ("dp", "tp")
                if len(shape) == 2
                else ("pp", "dp", "tp")
                if len(shape) == 3
                else tuple(f"d{i}" for i in range(len(shape)))
            )
        names = tuple(names)
        if len(names) != len(shape):
            raise ValueError(f"MeshSpec has {len(shape)} dims {shape} but {len(names)} names {names}")
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n.isidentifier() for n in names):
            raise ValueError(f"MeshSpec dim names must be distinct identifiers, got {names}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "names", names)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __str__(self):
        return "x".join(map(str, self.shape)) + "(" + ",".join(self.names) + ")"

    @classmethod
    def parse(cls, text: str, names: str | None = None) -> "MeshSpec":
        """'8x8' or '2x4' (optionally with names 'dp,tp')."""
        if not re.fullmatch(r"\d+(x\d+)*", text.strip()):
            raise ValueError(f"mesh '{text}' must look like 8 or 8x8 or 2x2x4")
        return cls(tuple(int(x) for x in text.split("x")), tuple(names.split(",")) if names else None)


def as_mesh_spec(mesh) -> MeshSpec:
    if isinstance(mesh, MeshSpec):
        return mesh
    if isinstance(mesh, str):
        return MeshSpec.parse(mesh)
    if isinstance(mesh, (tuple, list)):
        return MeshSpec(tuple(mesh))
    shape = getattr(mesh, "shape", None)
    if shape is not None and hasattr(mesh, "mesh_dim_names"):
        return MeshSpec(tuple(int(s) for s in shape), tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None)
    raise TypeError(f"mesh must be a DeviceMesh, MeshSpec, 'AxB' string or shape tuple, got {type(mesh).__name__}")
