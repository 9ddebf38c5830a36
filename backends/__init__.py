"""Backends that run a plan. `graph`: the SPMD graph executor behind `autopar.parallelize` (DTensors, explicit
collectives from `comm`). Imported lazily by `autopar.parallelize`; planning never imports this package."""
