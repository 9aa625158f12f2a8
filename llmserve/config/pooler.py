"""The pooling runner's options (vLLM's `--runner pooling`, `--convert`, `--pooler-config`).

An engine with `runner="pooling"` answers embedding, classification and score requests
(one prefill each, nothing sampled) and refuses generation. `convert` says what its output
is: "embed" (the pooled hidden state) or "classify" (a head over it: the checkpoint's
`score` layer, as `*ForSequenceClassification` folders hold, or the LM head's logits of the
`classifier_from_token` tokens, as Qwen3-Reranker's yes/no method uses).
"""

import json
from dataclasses import dataclass
from typing import Any

RUNNERS = ("generate", "pooling")
CONVERTS = ("embed", "classify")
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """LAST: the last prompt token's final hidden state (decoder embedders such as
    Qwen3-Embedding, and sequence classifiers); MEAN: the average over the prompt; CLS:
    the first token's. `normalize`: L2-normalise embeddings unless a request says otherwise.
    """

    pooling_type: str = "LAST"
    normalize: bool = True
    classifier_from_token: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        kind = self.pooling_type.upper() if isinstance(self.pooling_type, str) else None
        if kind not in POOLING_TYPES:
            raise ValueError(f"pooler_config: pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, not {self.pooling_type!r}")
        object.__setattr__(self, "pooling_type", kind)
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config: normalize must be true or false, not "
                             f"{self.normalize!r}")
        tokens = self.classifier_from_token
        if tokens is not None:
            if (isinstance(tokens, str) or not all(isinstance(t, str) for t in tokens)
                    or len(tokens) < 2):
                raise ValueError("pooler_config: classifier_from_token must be a list of at "
                                 f"least two token strings, not {tokens!r}")
            object.__setattr__(self, "classifier_from_token", tuple(tokens))

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS read hidden states a prefix-cache hit would skip."""
        return self.pooling_type != "LAST"

    @classmethod
    def from_value(cls, value: "PoolerConfig | dict | str | None") -> "PoolerConfig":
        """From a PoolerConfig, its dict or JSON form (`--pooler-config '{...}'`), or None."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"pooler_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be an object, not {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"pooler_config: unknown key {unknown[0]!r} (known: "
                             f"{', '.join(sorted(known))})")
        options: dict[str, Any] = dict(value)
        return cls(**options)
