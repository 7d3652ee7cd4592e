"""Tensor parallelism inside one engine: the rank layout, the collectives the model calls
(shared-memory or torch.distributed), and the executor that runs a step on every rank
(docs/parallelism.md)."""
