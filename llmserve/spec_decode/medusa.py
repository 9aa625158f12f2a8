"""Medusa heads: drafts read off the target's own last hidden state (Medusa-1).

Head i is a stack of residual blocks (x + SiLU(W x + b), `num_layers` of them) and an LM
head. From the target's final hidden state at the last verified position (the row whose
logits gave the token just sampled), head i proposes the token i + 1 places after that
sampled token; all heads read the same row, so a round of k drafts costs k small head
evaluations and no draft-model forward. Drafts are each head's argmax, a point mass, which
the rejection rule verifies exactly (`worker/rejection_sampler.py`): the output keeps the
target's distribution whatever the heads propose.

A head checkpoint is a folder with `config.json` and safetensors weights, in either public
layout:

* Medusa's own (`medusa_lm_head.safetensors`; config `medusa_num_heads`,
  `medusa_num_layers`): `{i}.{j}.linear.weight|bias` for block j of head i, and
  `{i}.{num_layers}.weight` for its LM head (Medusa's blocks always have a bias);
* vLLM's (`"architectures": ["MedusaModel"]`; config `num_heads`, `num_hidden_layers`,
  `medusa_fc_bias`, `truncated_vocab_size` with a `token_map` tensor, `original_lm_head`):
  `blocks.{i}.layers.{j}.weight|bias` and `lm_heads.{i}.weight` (one shared LM head,
  `lm_heads.0.weight`, with `original_lm_head`).

With `original_lm_head` and no LM head in the file, the heads share the target's own LM
head (in its own format): what `llmserve train-heads` writes, a few MB instead of one
vocabulary-sized matrix per head.
"""

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from llmserve.spec_decode.proposer import Proposer
from llmserve.worker.drafts import DraftSeed
from llmserve.worker.sampler import argmax

if TYPE_CHECKING:
    from llmserve.config.engine import SpeculativeConfig
    from llmserve.loader.model_loader import LoadedModel

WEIGHT_FILES = ("medusa_lm_head.safetensors", "model.safetensors")
_MEDUSA_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")
_MEDUSA_HEAD = re.compile(r"(\d+)\.(\d+)\.weight")
_VLLM_BLOCK = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")
_VLLM_HEAD = re.compile(r"lm_heads\.(\d+)\.weight")


class HeadsFormatError(ValueError):
    """A head checkpoint that cannot be read or does not fit the target."""


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int  # residual blocks per head
    fc_bias: bool
    original_lm_head: bool  # one LM head shared by the heads (or the target's)
    truncated_vocab_size: int | None  # heads over the `token_map`'s tokens only
    hidden_size: int | None
    vocab_size: int | None

    @classmethod
    def from_json(cls, config: dict) -> "MedusaConfig":
        if "medusa_num_heads" in config:  # Medusa's own layout
            return cls(int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1)),
                       True, bool(config.get("original_lm_head", False)), None,
                       config.get("hidden_size"), config.get("vocab_size"))
        if "num_heads" in config:  # vLLM's
            truncated = config.get("truncated_vocab_size")
            vocab = config.get("vocab_size")
            return cls(int(config["num_heads"]), int(config.get("num_hidden_layers", 1)),
                       bool(config.get("medusa_fc_bias", False)),
                       bool(config.get("original_lm_head", False)),
                       None if truncated is None or truncated == vocab else int(truncated),
                       config.get("hidden_size"), vocab)
        raise HeadsFormatError("a Medusa config names its heads: medusa_num_heads "
                               "(Medusa's layout) or num_heads (vLLM's)")


class MedusaHeads(nn.Module):
    """The heads; `logits(i, hidden)` is head i's (N, V) over the target's vocabulary
    (-inf outside a truncated vocabulary), `target_logits` the target's LM head where the
    heads share it."""

    def __init__(self, config: MedusaConfig, hidden_size: int, vocab_size: int,
                 target_logits: Callable[[torch.Tensor], torch.Tensor],
                 has_lm_heads: bool) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.target_logits = target_logits
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=config.fc_bias)
                          for _ in range(config.num_layers))
            for _ in range(config.num_heads))
        rows = config.truncated_vocab_size or vocab_size
        num_lm_heads = 0 if not has_lm_heads else 1 if config.original_lm_head \
            else config.num_heads
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, rows, bias=False)
                                      for _ in range(num_lm_heads))
        self.token_map: torch.Tensor | None = None  # (rows,) target ids, truncated heads

    def features(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden
        for layer in self.blocks[i]:
            x = x + F.silu(layer(x))
        return x

    def logits(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head i's logits for the target's hidden rows `hidden` (N, H), any float dtype
        (the heads compute in float32; the target's LM head gets its own dtype back)."""
        return self._lm_logits(i, self.features(i, hidden.float()), hidden.dtype)

    def _lm_logits(self, i: int, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not len(self.lm_heads):
            return self.target_logits(x.to(dtype)).float()
        head = self.lm_heads[0 if self.config.original_lm_head else i]
        logits = head(x).float()
        if self.token_map is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.token_map] = logits
        return full

    @property
    def shares_lm_head(self) -> bool:
        return not len(self.lm_heads) or self.config.original_lm_head

    def propose(self, i: int, hidden: torch.Tensor) -> list[int]:
        """Head i's greedy token for each row of `hidden` (N, H)."""
        return argmax(self.logits(i, hidden)).tolist()

    def propose_first(self, num: int, hidden: torch.Tensor) -> list[list[int]]:
        """Heads 0..num-1's greedy tokens for each row of `hidden` (N, H): (num, N). Heads
        that share an LM head go through it in one call, so a round reads it once."""
        if not self.shares_lm_head:
            return [self.propose(i, hidden) for i in range(num)]
        x = torch.cat([self.features(i, hidden.float()) for i in range(num)])
        tokens = argmax(self._lm_logits(0, x, hidden.dtype)).tolist()
        n = hidden.shape[0]
        return [tokens[i * n:(i + 1) * n] for i in range(num)]


def read_head_config(folder: Path) -> tuple[Path, dict]:
    """A head folder's config.json: (its path, its contents)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise HeadsFormatError(f"speculative_config.model: no config.json in {folder}")
    try:
        return config_file, json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HeadsFormatError(f"{config_file}: {e}") from None


def load_medusa_heads(folder: str | Path, target: "LoadedModel",
                      device: torch.device) -> MedusaHeads:
    """Read a head folder (either layout) for `target`; refused by name when it does not
    fit (hidden size, vocabulary) or a tensor is missing, extra or misshapen."""
    folder = Path(folder)
    config_file, config_json = read_head_config(folder)
    config = MedusaConfig.from_json(config_json)
    hidden_size = target.config.hidden_size
    vocab_size = target.config.vocab_size
    for name, value, want in (("hidden_size", config.hidden_size, hidden_size),
                              ("vocab_size", config.vocab_size, vocab_size)):
        if value is not None and int(value) != want:
            raise HeadsFormatError(f"{config_file}: {name} {value} does not fit the target "
                                   f"{target.source.name} ({want})")
    tensors = _read_weights(folder)
    has_lm_heads = any(_lm_head_index(name, config) is not None for name in tensors)
    if not has_lm_heads and not config.original_lm_head:
        raise HeadsFormatError(f"{folder}: no LM head weights (and original_lm_head is not "
                               "set, which would share the target's)")
    heads = MedusaHeads(config, hidden_size, vocab_size, target.model.compute_logits,
                        has_lm_heads)
    _load(heads, tensors, config, folder)
    if heads.token_map is not None:
        heads.token_map = heads.token_map.to(device)
    return heads.to(device).eval()


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = folder / name
        if file.is_file():
            try:
                tensors = load_file(file)
            except (SafetensorError, OSError) as e:
                raise HeadsFormatError(f"{file}: {e}") from None
            return {_strip_prefix(k): v for k, v in tensors.items()}
    if any(folder.glob("*.pt")) or any(folder.glob("*.bin")):
        raise HeadsFormatError(f"{folder} holds pickled (.pt/.bin) head weights; only "
                               "safetensors are read (save them with safetensors.torch."
                               "save_file as medusa_lm_head.safetensors)")
    raise HeadsFormatError(f"no head weights in {folder} (looked for "
                           f"{', '.join(WEIGHT_FILES)})")


def _strip_prefix(name: str) -> str:
    for prefix in ("medusa_heads.", "medusa_head."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _lm_head_index(name: str, config: MedusaConfig) -> int | None:
    if (m := _VLLM_HEAD.fullmatch(name)) is not None:
        return int(m[1])
    m = _MEDUSA_HEAD.fullmatch(name)
    if m is not None and int(m[2]) == config.num_layers:
        return int(m[1])
    return None


def _parameter_name(name: str, config: MedusaConfig) -> str | None:
    """Our parameter for a checkpoint tensor's name (either layout), None: not a head's;
    "" for the other heads' copies of a shared LM head (read from head 0's)."""
    m = _VLLM_BLOCK.fullmatch(name) or _MEDUSA_BLOCK.fullmatch(name)
    if m is not None:
        return f"blocks.{m[1]}.{m[2]}.{m[3]}"
    index = _lm_head_index(name, config)
    if index is None:
        return None
    if config.original_lm_head:
        return "lm_heads.0.weight" if index == 0 else ""
    return f"lm_heads.{index}.weight"


def copy_head_tensor(param: torch.Tensor, name: str, tensor: torch.Tensor,
                     folder: Path) -> None:
    """A checkpoint tensor into its parameter, its shape checked."""
    if tuple(tensor.shape) != tuple(param.shape):
        raise HeadsFormatError(f"{folder}: {name} has shape {tuple(tensor.shape)}, "
                               f"expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))


@torch.no_grad()
def _load(heads: MedusaHeads, tensors: dict[str, torch.Tensor], config: MedusaConfig,
          folder: Path) -> None:
    params = dict(heads.named_parameters())
    loaded: set[str] = set()
    for name, tensor in tensors.items():
        if name == "token_map":
            if config.truncated_vocab_size is None:
                raise HeadsFormatError(f"{folder}: a token_map without truncated_vocab_size")
            heads.token_map = tensor.long()
            continue
        target = _parameter_name(name, config)
        if target == "":
            continue
        if target is None or target not in params:
            raise HeadsFormatError(f"{folder}: unexpected tensor {name!r} for "
                                   f"{config.num_heads} heads of {config.num_layers} "
                                   "block(s)")
        copy_head_tensor(params[target], name, tensor, folder)
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise HeadsFormatError(f"{folder}: missing head weights, e.g. {missing[0]!r}")
    if config.truncated_vocab_size is not None:
        token_map = heads.token_map
        if token_map is None or token_map.shape != (config.truncated_vocab_size,):
            raise HeadsFormatError(f"{folder}: truncated_vocab_size "
                                   f"{config.truncated_vocab_size} needs a token_map of "
                                   "that many target token ids")
        if int(token_map.min()) < 0 or int(token_map.max()) >= heads.vocab_size:
            raise HeadsFormatError(f"{folder}: token_map holds ids outside the vocabulary")


def save_medusa_heads(heads: MedusaHeads, folder: str | Path, extra: dict | None = None
                      ) -> Path:
    """Write `heads` in vLLM's layout (`config.json`, `model.safetensors`), the blocks
    only where they share the target's LM head; `extra` goes into the config under
    "llmserve" (how they were made). Each file is replaced whole (a checkpoint written
    while training is never half a file)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = heads.config
    tensors = {}
    for i, stack in enumerate(heads.blocks):
        for j, layer in enumerate(stack):
            tensors[f"blocks.{i}.layers.{j}.weight"] = layer.weight.detach().float().cpu()
            if layer.bias is not None:
                tensors[f"blocks.{i}.layers.{j}.bias"] = layer.bias.detach().float().cpu()
    for i, head in enumerate(heads.lm_heads):
        tensors[f"lm_heads.{i}.weight"] = head.weight.detach().float().cpu()
    if heads.token_map is not None:
        tensors["token_map"] = heads.token_map.cpu()
    meta = {"architectures": ["MedusaModel"], "num_heads": config.num_heads,
            "num_hidden_layers": config.num_layers, "medusa_fc_bias": config.fc_bias,
            "original_lm_head": config.original_lm_head, "hidden_size": heads.hidden_size,
            "vocab_size": heads.vocab_size}
    if config.truncated_vocab_size is not None:
        meta["truncated_vocab_size"] = config.truncated_vocab_size
    if extra:
        meta["llmserve"] = extra
    weights = folder / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights) + ".tmp")
    Path(str(weights) + ".tmp").replace(weights)
    config_file = folder / "config.json"
    Path(str(config_file) + ".tmp").write_text(json.dumps(meta, indent=2) + "\n")
    Path(str(config_file) + ".tmp").replace(config_file)
    return folder


class MedusaProposer(Proposer):
    """Drafts from Medusa heads on the target's hidden state (`DraftSeed.hidden`)."""

    needs_hidden = True

    def __init__(self, heads: MedusaHeads, device: torch.device, dtype: torch.dtype) -> None:
        self.heads = heads
        self.device = device
        self.dtype = dtype  # the target's hidden states'

    @classmethod
    def build(cls, spec: "SpeculativeConfig", target: "LoadedModel", device: torch.device,
              dtype: torch.dtype) -> "MedusaProposer":
        heads = load_medusa_heads(spec.model, target, device)
        if spec.num_speculative_tokens > heads.config.num_heads:
            raise ValueError(f"speculative_config: num_speculative_tokens "
                             f"{spec.num_speculative_tokens} is more than the "
                             f"{heads.config.num_heads} Medusa heads in {spec.model}")
        return cls(heads, device, dtype)

    @torch.inference_mode()
    def propose(self, seeds: Sequence[DraftSeed]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seeds]
        if not seeds:
            return drafts
        hidden = torch.stack([s.hidden[-1] for s in seeds])  # (N, H)
        by_head = self.heads.propose_first(max(s.num_drafts for s in seeds), hidden)
        return [[tokens[b] for tokens in by_head[: s.num_drafts]]
                for b, s in enumerate(seeds)]

    @torch.inference_mode()
    def step_seconds(self, batch: int, repeats: int = 5) -> float:
        """One head over `batch` rows, best of `repeats` (a draft token's proposing
        cost)."""
        rows = torch.randn(batch, self.heads.hidden_size, dtype=self.dtype, device=self.device)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            self.heads.propose_first(1, rows)
            best = min(best, time.perf_counter() - start)
        return best
