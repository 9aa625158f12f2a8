"""Pipeline parallelism: the decoder's layers in contiguous ranges, one per stage.

A stage is a tensor-parallel group (size T) holding layers [start, stop) of the model and
their KV cache; world = T x P ranks, rank = stage x T + (rank in its stage). Stage 0 also
holds the embedding and the LM head (a tied checkpoint keeps one table, and the sampling
rank, rank 0, computes the logits), the last stage the final norm. A step goes

    stage 0: embed, its layers -> send the residual stream (T, H) to stage 1
    stage s: receive, its layers -> send to stage s + 1
    last:    receive, its layers, norm -> send the final hidden states to stage 0
    stage 0: receive them -> logits, sampling (rank 0), drafts

each rank sending to the rank of the next stage with its own rank in the group (after a
stage's all-reduces every rank of it holds the whole residual stream). Sends do not wait
for their receiver: stage s is free for the next micro-batch as soon as it has sent, so
with P batches in flight (`engine.py`) every stage is busy at once. Activations go over
the ranks' channels (`channels.py`: TCP, half a round trip a message; on CUDA through
host memory).

How the layers are split (`stage_layers`): by each layer's and the LM head's time a step
in the kernels the model runs, measured on this CPU at the serving batch (rank 0 times
them once, cached; `loader.kernel_choice.stage_costs`), else by their parameters;
contiguous ranges minimising the largest stage (stage 0 with the head, counted for the
share of a serving step's tokens it samples: HEAD_SHARE), every stage at least one layer;
or the user's counts (`--pipeline-layer-partition`: hosts of different speeds).
"""

import time
from dataclasses import dataclass
from typing import Any

import torch

from llmserve.config.model import ModelConfig

ACTIVATION_TAG = 4  # the residual stream, stage to stage
FINAL_TAG = 5  # the last stage's final hidden states, to stage 0


@dataclass
class PipelineStage:
    """One rank's place in the pipeline (`size == 1`: no pipeline)."""

    index: int = 0
    size: int = 1
    layers: range = range(0)  # the decoder layers this stage holds
    channels: Any = None  # the ranks' `Channels`: activations are sent on them
    tp_rank: int = 0
    tp_size: int = 1
    # seconds this rank spent computing its stage and waiting for activations, since the
    # last `reset_timing` (`llmserve bench tp`)
    busy_seconds: float = 0.0
    wait_seconds: float = 0.0

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def assign(self, config: ModelConfig) -> "PipelineStage":
        """Take this stage's layers of a model with `config` (`stage_layers` by parameters),
        unless given already (rank 0 splits by measured costs and tells every rank)."""
        if not self.layers:
            self.layers = stage_layers(config, self.size)[self.index]
        return self

    def holds(self, name: str) -> bool:
        """Whether this stage holds checkpoint tensor `name` at all: its layers; stage 0
        the embedding and the LM head; every stage the final norm."""
        if name.startswith("model.layers."):
            return int(name.split(".", 3)[2]) in self.layers
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self.is_first
        return True

    def _rank_of(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank

    def receive(self, rows: int, width: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        """The previous stage's residual stream (rows, width)."""
        return self._receive(self._rank_of(self.index - 1), ACTIVATION_TAG, rows, width,
                             dtype, device)

    def receive_final(self, rows: int, width: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
        """Stage 0: the last stage's final hidden states (rows, width)."""
        return self._receive(self._rank_of(self.size - 1), FINAL_TAG, rows, width, dtype,
                             device)

    def send_on(self, x: torch.Tensor) -> None:
        """To the next stage (the last stage: its final hidden states to stage 0)."""
        if self.is_last:
            self._send(x, self._rank_of(0), FINAL_TAG)
        else:
            self._send(x, self._rank_of(self.index + 1), ACTIVATION_TAG)

    def _receive(self, peer: int, tag: int, rows: int, width: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        start = time.perf_counter()
        buffer = torch.empty(rows, width, dtype=dtype)
        self.channels.receive(peer, tag, memoryview(buffer.view(torch.uint8).numpy()).cast("B"))
        self.wait_seconds += time.perf_counter() - start
        return buffer.to(device)

    def _send(self, x: torch.Tensor, peer: int, tag: int) -> None:
        # the receiver may still be on an earlier micro-batch: the send is queued (the
        # tensor kept until written)
        buffer = x.detach().to("cpu").contiguous()
        self.channels.send(peer, tag, buffer.view(torch.uint8).numpy().reshape(-1))

    def flush(self) -> None:
        """Wait until every send is written."""
        if self.channels is not None:
            self.channels.flush()

    def reset_timing(self) -> None:
        self.busy_seconds = self.wait_seconds = 0.0


def layer_costs(cfg: ModelConfig) -> tuple[list[int], int]:
    """(each decoder layer's, the LM head's) parameters a decode step reads: attention,
    norms and the MLP (a mixture's router, shared expert and top_k experts)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attn = h * d * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2) + 4 * h
    costs = []
    for layer in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(layer):
            costs.append(attn + 3 * h * i)
            continue
        moe = cfg.moe
        shared = 3 * h * moe.shared_intermediate_size if moe.shared_intermediate_size else 0
        costs.append(attn + moe.num_experts * h + moe.top_k * 3 * h * moe.intermediate_size
                     + shared)
    return costs, cfg.vocab_size * h


def partition_layers(cfg: ModelConfig, partition: tuple[int, ...]) -> list[range]:
    """Contiguous ranges of `partition`'s layer counts, stage 0 first (the user's split:
    `--pipeline-layer-partition`); they must cover the model's layers."""
    n = cfg.num_hidden_layers
    if sum(partition) != n or min(partition) < 1:
        raise ValueError(f"pipeline_layer_partition {list(partition)} must give every stage "
                         f"at least one layer and add up to the model's {n} layers")
    bounds = [0]
    for count in partition:
        bounds.append(bounds[-1] + count)
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


# The layers run on every token a step computes, the LM head only on those it samples: a
# step of a serving mix computes prompt tokens beside the decodes. The split counts the
# head at this share of a decode step's cost: as many prompt tokens computed as tokens
# generated (stage 0 also runs the engine, the server and the sampling, which a larger
# share would leave no room for). Measured on the default model, 16 streams of 128-token
# prompts and 64-token answers, two stages of one thread on a Zen 3 (busy shares of
# stage 0 / stage 1): layers 8 | 22 (the head at its decode cost) 55 % / 91 %, 11 | 19
# (this share) 70 % / 83 %, 12 | 18 75 % / 80 %, 14 | 16 85 % / 70 %.
HEAD_SHARE = 0.5


def stage_layers(cfg: ModelConfig, size: int,
                 costs: tuple[list[float], float] | None = None) -> list[range]:
    """Contiguous layer ranges, one per stage, minimising the largest stage's cost (stage 0
    counts the LM head at HEAD_SHARE of its cost a decode step): `costs` (each layer's,
    the head's a decode step: measured, `loader.kernel_choice.stage_costs`), else what a
    decode step reads (`layer_costs`); every stage at least one layer."""
    costs, head = costs or layer_costs(cfg)
    head *= HEAD_SHARE
    n = len(costs)
    if not 1 <= size <= n:
        raise ValueError(f"pipeline_parallel_size {size} must be between 1 and the model's "
                         f"{n} layers")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][j]: the least possible largest stage for layers [0, j) over stages [0, s]
    best = [[inf] * (n + 1) for _ in range(size)]
    cut = [[0] * (n + 1) for _ in range(size)]
    for j in range(1, n + 1):
        best[0][j] = head + prefix[j]
    for s in range(1, size):
        for j in range(s + 1, n + 1):
            for k in range(s, j):  # stage s takes [k, j)
                value = max(best[s - 1][k], prefix[j] - prefix[k])
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, k
    bounds, j = [n], n
    for s in range(size - 1, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


@dataclass(frozen=True)
class StepPlan:
    """What one decode step of one stream costs on a layout over hosts (`plan_step`)."""

    stages: list[range]
    stage_weight_bytes: list[int]
    link_bytes_per_token: int  # one hop's activation bytes, a token in flight
    link_hops: int  # link crossings a step waits for, one after another
    compute_s: float
    link_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.link_s


def plan_step(cfg: ModelConfig, weight_bytes: int, pipeline_size: int, tensor_size: int,
              read_bytes_per_s: float, link_bytes_per_s: float, link_latency_s: float,
              tensor_across_hosts: bool = False) -> StepPlan:
    """A decode step of one stream on `tensor_size` x `pipeline_size` ranks, one stage per
    host: every stage reads its share of `weight_bytes` (split as `stage_layers` splits
    the work) at `read_bytes_per_s` (a decode step is bound by memory), one stage after
    another; the step crosses a link at each stage boundary and once back to stage 0, each
    crossing the one-way latency plus the hidden state's bytes at the link's rate. With
    `tensor_across_hosts` the tensor-parallel exchanges cross it too: two a layer and two
    more (the embedding's sum, the logits' gather), each sending a rank's share."""
    stages = stage_layers(cfg, pipeline_size)
    costs, head = layer_costs(cfg)
    total = sum(costs) + head
    shares = [sum(costs[i] for i in r) + head * (s == 0) for s, r in enumerate(stages)]
    stage_bytes = [round(weight_bytes * share / total) for share in shares]
    hidden_bytes = cfg.hidden_size * 4  # float32 activations
    hops = pipeline_size if pipeline_size > 1 else 0
    link_s = hops * (link_latency_s + hidden_bytes / link_bytes_per_s)
    if tensor_across_hosts and tensor_size > 1:
        exchanges = 2 * cfg.num_hidden_layers + 2
        link_s += exchanges * (link_latency_s
                               + (tensor_size - 1) * hidden_bytes / link_bytes_per_s)
    compute_s = sum(b / tensor_size for b in stage_bytes) / read_bytes_per_s
    return StepPlan(stages, stage_bytes, hidden_bytes, hops, compute_s, link_s)
