"""`llmserve bench embed`: embeddings per second of the pooling runner against
sentence-transformers on the same weights, side by side in one process.

The texts are the quality text's sentences (`bench/quality.py`), 20-80 tokens each. Each
side embeds all of them once to warm up, then `repeat` times timed: llmserve one text per
call (batch 1) or every text at once (batch > 1: its scheduler packs up to
max_num_batched_tokens prompt tokens a step, unpadded); sentence-transformers
`encode(batch_size=batch)` (padded batches of that many). Both use every thread
torch has. The two sides' embeddings are compared too (their lowest cosine), so a fast
wrong answer cannot pass unseen.

sentence-transformers reads a Hugging Face folder, or a GGUF file through transformers' own
GGUF reader (not llmserve's).
"""

import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from llmserve.bench.quality import quality_text
from llmserve.errors import LLMServeError

ST_POOLING = {"LAST": "lasttoken", "MEAN": "mean", "CLS": "cls"}


@dataclass
class EmbedResult:
    engine: str  # "llmserve" or "sentence-transformers"
    batch: int
    num_texts: int
    num_tokens: int
    seconds: float

    @property
    def embeddings_per_s(self) -> float:
        return self.num_texts / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds


def bench_texts(num_texts: int) -> list[str]:
    """`num_texts` sentences of the quality text (cycled if it has fewer)."""
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", quality_text())
                 if len(s.split()) >= 12]
    return [sentences[i % len(sentences)] for i in range(num_texts)]


def run_llmserve(llm: Any, texts: list[str], batch: int, repeat: int
                 ) -> tuple[EmbedResult, torch.Tensor]:
    llm.embed(texts, use_tqdm=False)  # warm-up (the caller turned the prefix cache off)
    start = time.perf_counter()
    for _ in range(repeat):
        if batch == 1:
            outputs = [llm.embed(t, use_tqdm=False)[0] for t in texts]
        else:
            outputs = llm.embed(texts, use_tqdm=False)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs) * repeat
    vectors = torch.tensor([o.outputs.embedding for o in outputs])
    return EmbedResult("llmserve", batch, len(texts) * repeat, num_tokens, seconds), vectors


def sentence_transformer(model: str, pooling_type: str, normalize: bool) -> Any:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise LLMServeError("bench embed compares with sentence-transformers, which is not "
                            "installed: pip install -e '.[bench]'") from None
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )

    # plain text in, as llmserve gets it: without this, sentence-transformers renders text
    # through a model's chat template when its tokenizer has one
    text_only = {"modality_config": {"text": {"method": "forward",
                                              "method_output_name": "last_hidden_state"}},
                 "module_output_name": "token_embeddings"}
    path = Path(model)
    if path.suffix == ".gguf":  # transformers' own GGUF reader, through sentence-transformers
        gguf = {"gguf_file": path.name}
        transformer = Transformer(str(path.parent), model_kwargs=gguf | {"dtype": torch.float32},
                                  processor_kwargs=gguf, config_kwargs=gguf, **text_only)
    else:
        transformer = Transformer(str(path), **text_only)
    tokenizer = transformer.tokenizer
    if tokenizer.pad_token is None:  # padded batches need one; the attention mask hides it
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(0)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(),
                                    pooling_mode=ST_POOLING[pooling_type])]
    if normalize:
        modules.append(Normalize())
    return SentenceTransformer(modules=modules, device="cpu")


def run_sentence_transformers(st: Any, texts: list[str], batch: int, repeat: int,
                              tokenizer: Any) -> tuple[EmbedResult, torch.Tensor]:
    st.encode(texts, batch_size=batch, convert_to_tensor=True)  # warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        vectors = st.encode(texts, batch_size=batch, convert_to_tensor=True)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(tokenizer.encode(t)) for t in texts) * repeat
    return (EmbedResult("sentence-transformers", batch, len(texts) * repeat, num_tokens,
                        seconds), vectors.float().cpu())


def lowest_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double(), b.double(), dim=-1).min())


def format_table(results: list[EmbedResult], cosines: dict[int, float]) -> str:
    lines = [f"{'engine':<22} {'batch':>5} {'texts':>6} {'emb/s':>9} {'tok/s':>9} "
             f"{'vs s-t':>7} {'min cos':>9}"]
    by_batch = {(r.engine, r.batch): r for r in results}
    for r in results:
        peer = by_batch.get(("sentence-transformers", r.batch))
        ratio = f"{r.embeddings_per_s / peer.embeddings_per_s:.2f}x" if peer else "-"
        lines.append(f"{r.engine:<22} {r.batch:>5} {r.num_texts:>6} "
                     f"{r.embeddings_per_s:>9.1f} {r.tokens_per_s:>9.0f} {ratio:>7} "
                     f"{cosines.get(r.batch, float('nan')):>9.6f}")
    return "\n".join(lines)


def report(results: list[EmbedResult], cosines: dict[int, float], options: dict[str, Any],
           machine: dict[str, Any]) -> dict[str, Any]:
    return {"options": options, "machine": machine,
            "results": [asdict(r) | {"embeddings_per_s": r.embeddings_per_s,
                                     "tokens_per_s": r.tokens_per_s} for r in results],
            "lowest_cosine_by_batch": {str(k): v for k, v in cosines.items()}}
