"""Backends that run a finished plan, one package per engine: `spmd` (the graph executor behind
`autopar.parallelize`: DTensors, explicit collectives). Imported lazily by `autopar.parallelize`; planning never
imports this package."""
