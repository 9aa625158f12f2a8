"""Tensor-parallel groups and how a model's heads, channels and vocabulary are split.

A `TensorParallel` is one rank's view of its group: rank, size, and the two collectives the
model needs (an all-reduce of partial sums after each row-parallel linear, an all-gather
of vocabulary shards of the logits), on `torch.distributed` (gloo on the CPU, NCCL on CUDA).
It also keeps the time spent in them, for `llmserve bench tp`.

How a model is split (`ShardPlan`):
* attention by KV-head group: each rank takes whole KV heads with the query heads that read
  them (`attention_shard`), so any size up to the number of KV heads works, even when it
  does not divide the number of heads (9 query and 3 KV heads at size 2: rank 0 takes KV
  heads 0-1 with query heads 0-5, rank 1 KV head 2 with query heads 6-8; o_proj's input is
  split to match). Beyond the KV-head count, KV heads are replicated: the ranks sharing a
  KV head split its query heads. The price of an uneven split is balance: the step waits
  for the rank with the most heads (2 of 3 KV heads at size 2: attention and qkv/o
  projections run at 2/3 of their work on rank 0 instead of 1/2);
* the MLP's intermediate channels in near-equal contiguous ranges, in units of 32 (an int4
  weight group, so a quantized down_proj keeps the checkpoint's own groups);
* the vocabulary (embedding rows and LM head rows) in near-equal contiguous ranges.
"""

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from llmserve.distributed.pipeline import PipelineStage

# intermediate channels are split in multiples of this (one int4 group along K of down_proj)
MLP_SPLIT_UNIT = 32
# On gloo, tensors up to this size are summed by a direct exchange (each rank sends its
# part to every other with `send`/`recv`, then all add the parts in rank order): measured
# on 2 local processes with (1, 576) fp32, 165 us against 1.9 ms for gloo's all-reduce
# (ring) and 0.9 ms for its all-gather. Larger tensors take gloo's all-reduce.
EXCHANGE_MAX_BYTES = 4 << 20
EXCHANGE_TAG = 2
CHAIN_TAG = 3


@dataclass
class TensorParallel:
    """One rank of a tensor-parallel group (`size == 1`: no group, no communication)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    exchange: bool = False  # gloo: small sums and gathers by direct exchange (see above)
    comm_seconds: float = 0.0  # time inside collectives since the last `reset_timing`
    comm_calls: int = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks (the partial sums of a row-parallel linear); every rank
        gets the same bits."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        if self.exchange and x.numel() * x.element_size() <= EXCHANGE_MAX_BYTES:
            parts = self._exchange(x)
            x = parts[0].clone()
            for part in parts[1:]:  # rank order on every rank: the same sum everywhere
                x += part
        else:
            dist.all_reduce(x, group=self.group)
        self._count(start)
        return x

    def row_parallel(self, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`linear` (this rank's columns of a row-parallel layer) applied to `x` (this
        rank's share of its input), summed over the ranks.

        On the exact float32 path (the native GEMM, whose multiply-adds run in k order)
        the ranks chain instead of adding partial sums: rank r continues rank r - 1's
        accumulators over its own columns, and the last rank's result, the one-rank
        result bit for bit, goes to every rank. Elsewhere: the partial sums' all-reduce.
        """
        if self.size == 1:
            return linear(x)
        from llmserve.quantization.packed_float import PackedFloatLinearMethod, float_linear

        if not self.exchange or not isinstance(linear.method, PackedFloatLinearMethod):
            return self.all_reduce(linear(x))
        rows = x.reshape(-1, x.shape[-1])
        last = self.size - 1
        start = time.perf_counter()
        init = None
        if self.rank > 0:
            init = torch.empty(rows.shape[0], linear.out_features)
            self.group.recv([init], self.rank - 1, CHAIN_TAG).wait()
        self.comm_seconds += time.perf_counter() - start
        out = float_linear(rows, linear.method.weight,
                           linear.bias if self.rank == last else None, init)
        start = time.perf_counter()
        if self.rank < last:
            self.group.send([out], self.rank + 1, CHAIN_TAG).wait()
            self.group.recv([out], last, CHAIN_TAG).wait()
        else:
            works = [self.group.send([out], peer, CHAIN_TAG) for peer in range(last)]
            for work in works:
                work.wait()
        self._count(start)
        return out.reshape(*x.shape[:-1], linear.out_features)

    def all_gather_rows(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """(N, sizes[rank]) per rank -> (N, sum(sizes)), rank order (vocabulary shards)."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        width = max(sizes)
        if x.shape[1] < width:  # equal shapes for the collective; the padding is cut off
            x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
        x = x.contiguous()
        if self.exchange and x.numel() * x.element_size() <= EXCHANGE_MAX_BYTES:
            parts = self._exchange(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        out = torch.cat([p[:, :n] for p, n in zip(parts, sizes, strict=True)], dim=1)
        self._count(start)
        return out

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x`, in rank order, by point-to-point sends and receives."""
        x = x.contiguous()
        parts: list[torch.Tensor] = []
        works = [self.group.send([x], peer, EXCHANGE_TAG)
                 for peer in range(self.size) if peer != self.rank]
        for peer in range(self.size):
            if peer == self.rank:
                parts.append(x)
                continue
            part = torch.empty_like(x)
            works.append(self.group.recv([part], peer, EXCHANGE_TAG))
            parts.append(part)
        for work in works:
            work.wait()
        return parts

    def _count(self, start: float) -> None:
        self.comm_seconds += time.perf_counter() - start
        self.comm_calls += 1

    def reset_timing(self) -> None:
        self.comm_seconds, self.comm_calls = 0.0, 0


def split_evenly(n: int, parts: int, unit: int = 1) -> list[range]:
    """[0, n) as `parts` contiguous ranges, sizes multiples of `unit` (the last takes any
    rest) as equal as that allows, larger ones first."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    units, rest = divmod(n, unit)
    if units < parts:
        unit, units, rest = 1, n, 0
    base, extra = divmod(units, parts)
    ranges, start = [], 0
    for p in range(parts):
        size = (base + (p < extra)) * unit + (rest if p == parts - 1 else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


@dataclass(frozen=True)
class AttentionShard:
    """The query heads and KV heads one rank computes (contiguous ranges of head indices)."""

    q_heads: range
    kv_heads: range


def attention_shard(num_heads: int, num_kv_heads: int, rank: int, size: int
                    ) -> AttentionShard:
    """Split attention by KV-head group (see the module docstring)."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if size <= num_kv_heads:
        kv = split_evenly(num_kv_heads, size)[rank]
        return AttentionShard(range(kv.start * group, kv.stop * group), kv)
    kv_head = rank * num_kv_heads // size
    sharing = [r for r in range(size) if r * num_kv_heads // size == kv_head]
    if len(sharing) > group:
        raise ValueError(
            f"tensor_parallel_size {size} is too large for {num_heads} query heads in "
            f"{num_kv_heads} KV-head groups: a rank would get no query head")
    q = split_evenly(group, len(sharing))[sharing.index(rank)]
    first = kv_head * group
    return AttentionShard(range(first + q.start, first + q.stop), range(kv_head, kv_head + 1))


@dataclass(frozen=True)
class ShardPlan:
    """What one rank holds of a decoder model."""

    tp: TensorParallel
    attention: AttentionShard
    mlp: range  # intermediate channels
    vocab: range  # embedding / LM head rows
    vocab_sizes: tuple[int, ...]  # every rank's vocabulary share, for the all-gather
    experts: range = range(0)  # a mixture's experts, whole (expert parallelism)
    # pipeline parallelism: this rank's stage and its layers (`distributed/pipeline.py`);
    # None: every layer
    stage: "PipelineStage | None" = None

    @classmethod
    def build(cls, tp: TensorParallel, num_heads: int, num_kv_heads: int,
              intermediate_size: int, vocab_size: int, num_experts: int = 0,
              stage: "PipelineStage | None" = None) -> "ShardPlan":
        if tp.size > num_heads:
            raise ValueError(f"tensor_parallel_size {tp.size} exceeds the model's "
                             f"{num_heads} attention heads")
        if num_experts and tp.size > num_experts:
            raise ValueError(f"tensor_parallel_size {tp.size} exceeds the model's "
                             f"{num_experts} experts")
        vocab = split_evenly(vocab_size, tp.size)
        experts = split_evenly(num_experts, tp.size)[tp.rank] if num_experts else range(0)
        return cls(tp, attention_shard(num_heads, num_kv_heads, tp.rank, tp.size),
                   split_evenly(intermediate_size, tp.size, MLP_SPLIT_UNIT)[tp.rank],
                   vocab[tp.rank], tuple(len(r) for r in vocab), experts,
                   stage if stage is not None and stage.size > 1 else None)

    def weight_slices(self, name: str, head_dim: int) -> tuple[slice | None, slice | None]:
        """(rows, columns) of checkpoint tensor `name` (Hugging Face Llama names) that this
        rank holds; None: all of that dimension."""
        if self.stage is not None and not self.stage.holds(name):
            return slice(0, 0), None  # another stage's: nothing of it is read
        q = self.attention.q_heads
        kv = self.attention.kv_heads
        if ".mlp.experts." in name:  # whole experts, this rank's only (nothing of others)
            expert = int(name.split(".mlp.experts.", 1)[1].split(".", 1)[0])
            return (None, None) if expert in self.experts else (slice(0, 0), None)
        if ".mlp.shared_expert." in name:
            return None, None  # every rank holds the shared expert whole
        if ".q_proj." in name:
            return slice(q.start * head_dim, q.stop * head_dim), None
        if ".k_proj." in name or ".v_proj." in name:
            return slice(kv.start * head_dim, kv.stop * head_dim), None
        if ".o_proj." in name:
            return None, slice(q.start * head_dim, q.stop * head_dim)
        if ".gate_proj." in name or ".up_proj." in name:
            return slice(self.mlp.start, self.mlp.stop), None
        if ".down_proj." in name:
            return None, slice(self.mlp.start, self.mlp.stop)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return slice(self.vocab.start, self.vocab.stop), None
        return None, None
