"""The executor a `--distributed-executor-backend` names."""

import torch

from llmserve.config.engine import DISTRIBUTED_EXECUTOR_BACKENDS
from llmserve.executor.executor import (
    ExternalExecutor,
    MultiprocExecutor,
    TensorParallelExecutor,
)
from llmserve.executor.ray_executor import RayExecutor


def make_executor(backend: str, size: int, device: torch.device,
                  num_threads: int | None, pipeline_size: int = 1) -> TensorParallelExecutor:
    """`size` ranks in all (tensor x pipeline parallel)."""
    if backend == "mp":
        return MultiprocExecutor(size, device, num_threads, pipeline_size)
    if backend == "external_launcher":
        return ExternalExecutor(size, device, pipeline_size)
    if backend == "ray":
        return RayExecutor(size, device, num_threads, pipeline_size)
    raise ValueError(f"distributed_executor_backend must be one of "
                     f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, not {backend!r}")
