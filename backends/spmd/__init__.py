"""The SPMD graph executor: runs a finished Plan's captured graph node by node on this rank's shards, with the
plan's own collectives (comm), gradient buckets (buckets) and optional torch.compile of the local runs (compiled)."""
