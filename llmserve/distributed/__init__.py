"""Tensor parallelism on `torch.distributed`: groups, how a model is split, and the
processes that run the other ranks (`executor.py`, `worker.py`)."""
