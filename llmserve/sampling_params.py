"""SamplingParams: what a request asks of generation, validated at construction.

Field names follow vLLM's. A value out of range raises `ValueError` whose message names the
field and the allowed range.
"""

from dataclasses import dataclass, field

MAX_STOP_STRINGS = 64
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick the next tokens and when to stop.

    `temperature=0` is greedy. `top_k` of 0 or -1 disables top-k; `top_p=1` and `min_p=0`
    disable theirs. `seed` makes a request's samples reproducible whatever else is batched
    with it. Stop strings are matched on the detokenized text and are not returned unless
    `include_stop_str_in_output`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens", f"must be at least 1, got {self.max_tokens}",
        )
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
        )
        _check(all(self.stop), "stop", "stop strings must be non-empty")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
