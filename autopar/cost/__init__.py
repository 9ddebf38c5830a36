"""Analytic cost model: cluster specs, alpha-beta collectives, roofline compute, model-state memory."""

from .cluster import DeviceSpec, LinkSpec, ClusterSpec, CLUSTERS, RING_CLUSTERS, get_cluster
from .comm import KINDS, bytes_sent, bus_bandwidth, ring_steps, collective_time, collective_time_expr
from .compute import (
    global_flops,
    op_flops,
    op_bytes,
    op_time,
    roofline_time,
    compute_dtype,
    has_flop_formula,
    tensor_bytes,
    is_view,
)
from .memory import (
    TrainingPrecision,
    model_state_bytes,
    zero_bytes,
    ZERO_STAGES,
    valid_tp_degrees,
    sp_activation_saving_bytes,
)

__all__ = [
    "DeviceSpec",
    "LinkSpec",
    "ClusterSpec",
    "CLUSTERS",
    "RING_CLUSTERS",
    "get_cluster",
    "KINDS",
    "bytes_sent",
    "bus_bandwidth",
    "ring_steps",
    "collective_time",
    "collective_time_expr",
    "global_flops",
    "op_flops",
    "op_bytes",
    "op_time",
    "roofline_time",
    "compute_dtype",
    "has_flop_formula",
    "tensor_bytes",
    "is_view",
    "TrainingPrecision",
    "model_state_bytes",
    "zero_bytes",
    "ZERO_STAGES",
    "valid_tp_degrees",
    "sp_activation_saving_bytes",
]
