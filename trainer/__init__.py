"""hybridtrain's trainer: a heterogeneity-aware parameter server with adaptive Top-k compression.

Rank 0 is the server for the `ps*` strategies, ranks 1..W-1 are workers; the `allreduce*`
strategies run PyTorch DDP on every rank. `trainer.cli.main` is the entry point.
"""
