"""Overlap as torch's engines schedule it: the exposed communication of one step, term by term.

Each function is a small timeline over the streams the engine uses (compute, and one stream per kind of
collective), in the order the engine issues work; "exposed" is the step's length minus its compute.

- FSDP2 (`fsdp_timeline`): the all-gather of unit i+1 runs under the compute of unit i (implicit prefetch: the
  all-gather stream runs one unit ahead; the first all-gather overlaps nothing, PyTorch's FSDP notes "FSDP
  Prefetch Nuances"); in the backward the units run in reverse, each re-gathered one unit ahead when it was
  resharded after the forward, and the reduce-scatter of unit i (its own stream) runs under the backward of the
  unit before it; the last one is exposed.
- DDP (`ddp_exposed`): gradient buckets all-reduce in the order they fill during the backward, one at a time;
  what runs past the backward's end is exposed.
- Tensor parallel: a TP collective sits between the matmuls that produce and consume it, so it is exposed
  (autopar/predict.py), unless async TP fuses it with its matmul (autopar/cost/async_tp.py: then only the part
  longer than the matmul's other chunks shows).
- The optimizer step (`optimizer_step_time`): memory bound, it reads and writes each rank's shard of the
  parameters, gradients and optimizer states once, so sharding them n ways divides it by n.
- Pipeline send/recv: passes/stage_costs.py simulates the schedule with each transfer on the critical path
  between stages (autopar/pipeline_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    """One FSDP unit (a `fully_shard` module): its forward and backward compute, the all-gather of its parameters,
    the reduce-scatter of its gradients (seconds). `regather`: it is all-gathered again for the backward
    (reshard_after_forward=True, FSDP2's default for every unit but the root); `ag_bw`: that gather's seconds when
    they differ from the forward's (a plan's records price the two gathers apart), else None (the same)."""

    fw: float
    bw: float
    ag: float
    rs: float
    regather: bool = True
    ag_bw: float | None = None

    @property
    def backward_gather(self) -> float:
        if not self.regather:
            return 0.0
        return self.ag if self.ag_bw is None else self.ag_bw


def _gathered_run(order, times, gathers, ag_free: float, c_end: float) -> tuple[float, float]:
    """Run `order`'s compute from c_end, each unit waiting for its all-gather, the all-gather stream one unit
    ahead: the first gather is issued when the run starts; the gather of unit k+1 starts once the stream is free
    and unit k-1 has finished (its unsharded buffer is free), so it runs under unit k. Returns (end of the compute,
    end of the all-gather stream) and leaves the end of each unit's compute in times[u][1]."""
    ag_end = max(ag_free, c_end) + gathers[order[0]] if order else ag_free
    for k, u in enumerate(order):
        start = max(c_end, ag_end)
        if k + 1 < len(order):
            ag_end = max(ag_end, c_end) + gathers[order[k + 1]]
        c_end = start + times[u][0]
        times[u][1] = c_end
    return c_end, ag_end


def fsdp_timeline(units: list[Unit]) -> dict:
    """Step seconds of forward then backward over `units` (in forward order) under FSDP2's schedule: step_s,
    compute_s, exposed_s (step - compute), and the end of each unit's forward / backward compute."""
    n = len(units)
    fw = [[u.fw, 0.0] for u in units]
    bw = [[u.bw, 0.0] for u in units]
    c_end, ag_end = _gathered_run(list(range(n)), fw, [u.ag for u in units], 0.0, 0.0)
    back = list(range(n - 1, -1, -1))
    c_end, _ = _gathered_run(back, bw, [u.backward_gather for u in units], ag_end, c_end)
    rs_end = 0.0
    for u in back:  # each reduce-scatter once its unit's backward is done, one at a time on its stream
        rs_end = max(rs_end, bw[u][1]) + units[u].rs
    step = max(c_end, rs_end)
    compute = sum(u.fw + u.bw for u in units)
    return {
        "step_s": step,
        "compute_s": compute,
        "exposed_s": step - compute,
        "fw_end_s": [t for _, t in fw],
        "bw_end_s": [t for _, t in bw],
    }


def ddp_exposed(ready_s: list[float], comm_s: list[float], backward_s: float) -> float:
    """Seconds the gradient all-reduces run past the backward: bucket k is ready at ready_s[k] (seconds into the
    backward, in the order DDP fills them) and takes comm_s[k]; the buckets run one after the other."""
    end = 0.0
    for r, c in zip(ready_s, comm_s):
        end = max(end, r) + c
    return max(0.0, end - backward_s)


def optimizer_step_bytes(n_params: float, precision, shards: float = 1) -> float:
    """Bytes one rank's AdamW-style step moves: it reads the weights it updates (the fp32 master where there is
    one), the gradient and each optimizer state, writes the weights and the states back, and writes the low-
    precision parameter copy when a master exists; all over the rank's 1/shards of the parameters."""
    weights = precision.master or precision.param
    states = precision.optim_states * precision.optim_bytes
    per = 2 * weights + precision.grad + 2 * states + (precision.param if precision.master else 0)
    return n_params * per / shards


def optimizer_step_time(n_params: float, precision, device, shards: float = 1) -> float:
    """Seconds of the optimizer step on one rank: optimizer_step_bytes at the device's achievable bandwidth."""
    return optimizer_step_bytes(n_params, precision, shards) / (device.mem_bw * device.mem_eff)
