"""Speculative decoding: draft tokens proposed cheaply, verified by the target model.

* `proposer.py`: the proposer interface, and prompt lookup (`ngram.py`: drafts copied
  from earlier in the sequence);
* `draft_model.py`: a draft model with its own small paged KV cache (also `self_draft`:
  the target's checkpoint on its quantized path, drafting for the exact path);
* `medusa.py`, `eagle.py`: heads that read the target's own hidden states (Medusa-1's
  residual heads; EAGLE-1's one-layer decoder, its K/V in the target's blocks), and
  `training.py`, Medusa heads trained by self-distillation (`llmserve train-heads`);
* `speculator.py`: the engine's policy (adaptive k per request, off for large batches)
  and running counts; `proposer_stage.py` applies it at the scheduler's edges.

Drafts are proposed after the forward: when a step is scheduled the policy says how many
drafts each sampling request wants (`ScheduledRequest.num_drafts`); once the step has
sampled, the runner asks the proposer for them (`worker/drafts.py`), and they come back in
`ModelRunnerOutput.draft_token_ids`. The scheduler sends a request's drafts after its
last token in the next step, the runner verifies them in the same forward
(`worker/model_runner.py`, by the rule in `worker/rejection_sampler.py`: every emitted
token is distributed as the target model's, greedy rows exactly the target's argmax), and
the engine takes the accepted tokens in order, stop conditions included
(`engine/engine.py`). The scheduler itself computes no model work.
"""
