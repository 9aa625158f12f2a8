"""Prompt lookup: draft tokens copied from earlier in the sequence.

The sequence's last n tokens (n from `max_n` down to `min_n`) are looked for earlier in
the sequence (prompt and output so far); at the latest earlier match, the up to k tokens
that followed it are the draft. Quoting, summarising, editing and code repeat long spans of
their input, so the target model often accepts several tokens at once.
"""

import numpy as np


def propose(token_ids: list[int] | np.ndarray, k: int, min_n: int = 1,
            max_n: int = 4) -> list[int]:
    """Up to `k` draft tokens for the sequence `token_ids` ([] when no n-gram recurs)."""
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n, got k={k}, "
                         f"min_n={min_n}, max_n={max_n}")
    seq = np.asarray(token_ids, dtype=np.int64)
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = seq[length - n:]
        # every start i < length - n whose n tokens equal the suffix (not the suffix itself)
        windows = np.lib.stride_tricks.sliding_window_view(seq[:length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            follow = int(starts[-1]) + n  # the latest earlier occurrence
            return seq[follow:follow + k].tolist()
    return []
