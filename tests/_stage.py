"""The context a stage's intra-op plans take (passes/stage_costs.py StageOps, passes/stage_search.py stage_plans):
fp32 AdamW, no loss_fn, nothing forced, the batch sharded over the dp dims."""

from autopar.cost import TrainingPrecision


def stage_context(cluster, n_variants: int, time_limit: float = 60, **extra) -> dict:
    return {
        "cluster": cluster,
        "precision": TrainingPrecision.fp32_adam(),
        "loss_fn": None,
        "force": {},
        "replicate_ops": [],
        "allow_replicate": False,
        "time_limit": time_limit,
        "n_variants": n_variants,
        "dp_shards_batch": True,
        **extra,
    }
