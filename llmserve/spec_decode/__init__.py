"""Speculative decoding: draft tokens proposed cheaply, verified by the target model.

* `ngram.py`: prompt lookup, drafts copied from earlier in the sequence.
* `rejection.py`: the verification rule, batched; every emitted token is distributed as
  the target model's (greedy rows: the target's argmax, exactly).

Not yet wired into the engine (issue 11 builds on these).
"""
