"""Tensor parallelism on `torch.distributed`: how a model is split across ranks
(`parallel.py`), and how KV blocks move between engines (`kv_transfer.py`). The processes
that run the other ranks are `llmserve.executor`."""
