"""A tensor tied between the first and the last pipeline stage (a tied input embedding and output head): each of
the two stages holds a copy (the plan lists it on the last stage under the head's name, plan.schedule["tied"]:
head's name -> the first stage's), each computes its part of the gradient, and after the step's backward the two
parts are summed between the two ranks (Megatron's embedding group), so both copies take the same optimizer step
from the whole gradient, as the one tensor does on one device. Priced in passes/stage_metrics.py."""

from __future__ import annotations

import torch


class TiedGrads:
    """The process groups joining, for every coordinate of the stage submesh, the rank of the first stage and the
    rank of the last (made by every rank, in one order, as torch.distributed.new_group requires), and the sum."""

    def __init__(self, plan, mesh, local_stages: list):
        import torch.distributed as dist

        self.tied = dict(plan.schedule.get("tied") or {})
        self.group, self.names = None, []
        if not self.tied:
            return
        S = len(plan.stages)
        r0, r1 = plan.stages[0]["pp_rank"], plan.stages[S - 1]["pp_rank"]
        if r0 == r1:
            raise NotImplementedError(
                f"tied parameters {sorted(self.tied)}: the first and the last stage are on one pp rank (schedule "
                f"{plan.schedule['name']}), which the runtime does not run with a tensor shared by two stage modules; "
                f"plan a loop schedule (1F1B, Interleaved1F1B, ...)"
            )
        grid = mesh.mesh.movedim(list(mesh.mesh_dim_names).index("pp"), 0)
        ranks = grid.reshape(grid.shape[0], -1)  # pp x every coordinate of the stage submesh
        me = dist.get_rank()
        for c in range(ranks.shape[1]):
            pair = [int(ranks[r0, c]), int(ranks[r1, c])]
            g = dist.new_group(pair)
            if me in pair:
                self.group = g
        if 0 in local_stages:
            self.names = sorted(self.tied.values())
        elif S - 1 in local_stages:
            back = {o: f for f, o in self.tied.items()}
            self.names = [back[o] for o in sorted(back)]  # the same tensors in the same order as the first stage

    def sum(self, named_parameters) -> None:
        """All-reduce each tied gradient between the first and the last stage (after the step's backward). A
        gradient sharded over the stage submesh (tensor parallel: the embedding row-wise on one stage, the head
        column-wise on the other, local pieces of other shapes) is summed whole and cut back to its placements."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Replicate

        if self.group is None or not self.names:
            return
        params = dict(named_parameters)
        with torch.no_grad():
            for name in self.names:
                g = params[name].grad
                if g is None:
                    raise RuntimeError(f"tied parameter '{name}' got no gradient on its stage")
                if not isinstance(g, DTensor):
                    dist.all_reduce(g, group=self.group)
                    continue
                whole = g.full_tensor()
                dist.all_reduce(whole, group=self.group)
                mine = DTensor.from_local(whole, g.device_mesh, [Replicate()] * g.device_mesh.ndim, run_check=False)
                g.to_local().copy_(mine.redistribute(g.device_mesh, g.placements).to_local())
