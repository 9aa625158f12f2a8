"""What a pooling request asks for (vLLM's `PoolingParams`): an embedding or class scores
from one prefill of its prompt, no token sampled.

    task="embed"     the pooled hidden state (`PoolerConfig.pooling_type`: LAST, MEAN or
                     CLS), cut to its first `dimensions` values (Matryoshka models) and
                     L2-normalised unless `normalize` is False
    task="classify"  the classifier head on the pooled state (a checkpoint's `score`
                     layer, or the LM head's logits of the `classifier_from_token` tokens):
                     softmax probabilities over the labels (one label: its sigmoid), the
                     raw logits if `use_activation` is False
"""

from dataclasses import dataclass

TASKS = ("embed", "classify")


@dataclass(frozen=True)
class PoolingParams:
    task: str = "embed"
    dimensions: int | None = None  # keep the first n values (before normalising)
    normalize: bool | None = None  # None: the engine's PoolerConfig.normalize
    use_activation: bool = True  # classify: probabilities (softmax / sigmoid), not logits
    truncate_prompt_tokens: int | None = None  # keep the prompt's last n tokens (-1: fit)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (
                isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.truncate_prompt_tokens is not None and (
                isinstance(self.truncate_prompt_tokens, bool)
                or not isinstance(self.truncate_prompt_tokens, int)
                or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)):
            raise ValueError("truncate_prompt_tokens must be a positive integer or -1, got "
                             f"{self.truncate_prompt_tokens!r}")
