"""`bench quality` on a tiny random Llama: a path against itself is exact, a perturbed one is
not; windows score every token once; the shipped text is long enough; CLI errors are one line.
"""

import json

import pytest
import torch

from llmserve import LLM
from llmserve.bench.quality import QualityText, evaluate, full_logits, plan_windows, quality_text
from llmserve.entrypoints.cli import main

WINDOW, MAX_TOKENS = 64, 200


@pytest.fixture(scope="module")
def reference(tiny_folder) -> LLM:
    return LLM(str(tiny_folder), dtype="float32", kv_cache_memory="4MiB")


@pytest.fixture(scope="module")
def scored(reference) -> QualityText:
    text = QualityText.build(reference, quality_text(), WINDOW, WINDOW, MAX_TOKENS)
    text.score_reference(reference)
    return text


def test_reference_against_itself_is_exact(reference, scored):
    result = evaluate(reference, scored, "self")
    print(f"self: KL {result.mean_kl:.2e}, top-1 {result.top1_agreement:.3f}, "
          f"ppl change {result.perplexity_change_pct:.2e}%")
    # no BOS: a window's first token has nothing to be predicted from
    assert result.num_tokens == MAX_TOKENS - len(scored.windows) == MAX_TOKENS - 4
    assert result.mean_kl == pytest.approx(0.0, abs=1e-9)
    assert result.top1_agreement == 1.0
    assert result.perplexity_change_pct == pytest.approx(0.0, abs=1e-9)
    assert result.perplexity == result.reference_perplexity > 1.0


def test_perturbed_candidate_drifts(tiny_folder, scored):
    candidate = LLM(str(tiny_folder), dtype="float32", kv_cache_memory="4MiB")
    torch.manual_seed(1)
    with torch.no_grad():
        for param in candidate.engine.loaded.model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    result = evaluate(candidate, scored, "perturbed")
    print(f"perturbed: KL {result.mean_kl:.2e}, top-1 {result.top1_agreement:.3f}, "
          f"ppl change {result.perplexity_change_pct:+.2f}%")
    assert result.mean_kl > 1e-4
    assert result.perplexity != result.reference_perplexity


def test_full_logits_match_a_longer_run(reference, scored):
    """The logits of a prefix do not depend on what follows it (causal, one prefill)."""
    ids = scored.ids[:40]
    assert torch.allclose(full_logits(reference, ids[:25]), full_logits(reference, ids)[:25],
                          atol=1e-5)


@pytest.mark.parametrize("window,stride", [(64, 64), (64, 16), (10, 7), (2, 1)])
@pytest.mark.parametrize("has_bos", [False, True])
def test_windows_score_each_token_at_most_once(window, stride, has_bos):
    num_tokens = 150
    windows = plan_windows(num_tokens, window, stride, has_bos)
    scored = [t for w in windows for t in range(w.first_scored, w.end)]
    assert scored == sorted(set(scored))
    unscored = set(range(num_tokens)) - set(scored)
    if has_bos:
        assert unscored == set()
    elif stride < window:  # overlapping windows give every later token some context
        assert unscored == {0}
    else:  # without BOS a window's first token has no context in it
        assert unscored == {w.start for w in windows}
    for w in windows:
        assert w.end - w.start <= window and w.start <= w.first_scored < w.end


def test_shipped_text_has_2000_tokens(smollm2_gguf):
    from llmserve.tokenizer import Tokenizer as LLMServeTokenizer

    tokenizer = LLMServeTokenizer.from_gguf(smollm2_gguf)
    num_tokens = len(tokenizer.encode(quality_text(), add_special_tokens=False))
    print(f"quality text: {num_tokens} SmolLM2 tokens")
    assert num_tokens >= 2000


def test_cli_writes_json(tiny_folder, tmp_path, capsys):
    out = tmp_path / "quality.json"
    code = main(["bench", "quality", "--model", str(tiny_folder), "--window", str(WINDOW),
                 "--max-tokens", "100", "--kv-cache-memory", "4MiB", "--output-json", str(out)])
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "torch cpu capability" in printed and "default (dtype auto)" in printed
    report = json.loads(out.read_text())
    assert report["machine"]["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    (default,) = report["candidates"]
    assert default["options"] == {} and default["num_tokens"] == 100 - 2  # windows 0, 64
    assert default["mean_kl"] == pytest.approx(0.0, abs=1e-9)  # auto is float32 on the CPU


def test_cli_rejected_option_is_one_line(tiny_folder, capsys):
    code = main(["bench", "quality", "--model", str(tiny_folder), "--max-tokens", "10",
                 "--window", "8", "--kv-cache-memory", "4MiB",
                 "--engine-arg", "no_such_option=1"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: ") and "no_such_option" in err and err.count("\n") == 1
    assert "Traceback" not in err


FAKE_LLAMA_PERPLEXITY = """#!{python}
import sys
args = sys.argv[1:]
opts = dict(zip(args[::2], args[1::2]))
assert opts["-c"] == opts["-b"] == "64", args
text = open(opts["-f"], encoding="utf-8").read()
assert text == open("{text}", encoding="utf-8").read() and opts["-m"] == "{model}"
print("perplexity: calculating perplexity over 8 chunks, n_ctx=64, batch_size=64, n_seq=1",
      file=sys.stderr)
print("Final estimate: PPL = 12.3456 +/- 0.5000")
"""


def test_side_by_side_with_llama_perplexity(smollm2_gguf, tmp_path, capsys):
    """--llama-perplexity runs the peer on the same file and text (a stand-in binary here:
    it checks what it is given) and scores every path as it scores: the second half of each
    back-to-back window."""
    import sys

    from llmserve.bench.quality import HalfWindowScoring

    text = tmp_path / "text.txt"
    text.write_text(quality_text()[:2400], encoding="utf-8")
    binary = tmp_path / "llama-perplexity"
    binary.write_text(FAKE_LLAMA_PERPLEXITY.format(python=sys.executable, text=text,
                                                   model=smollm2_gguf))
    binary.chmod(0o755)
    out = tmp_path / "quality.json"
    code = main(["bench", "quality", "--model", str(smollm2_gguf), "--window", "64",
                 "--text", str(text), "--llama-perplexity", str(binary),
                 "--kv-cache-memory", "16MiB", "--output-json", str(out)])
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "llama.cpp llama-perplexity      12.3456" in printed
    report = json.loads(out.read_text())
    assert report["llama.cpp"]["perplexity"] == 12.3456 and report["llama.cpp"]["windows"] == 8
    exact = LLM(str(smollm2_gguf), dtype="float32", kv_cache_memory="16MiB")
    half = HalfWindowScoring.build(exact, text.read_text(encoding="utf-8"), 64)
    assert half.num_windows == 8 and half.num_scored == 8 * 31  # positions 33 .. 63
    assert report["reference"]["half_window_perplexity"] == half.perplexity(exact)
    (default,) = report["candidates"]
    assert 1.0 < default["half_window_perplexity"] < 1.05 * half.perplexity(exact)
    assert f"{default['half_window_perplexity']:.4f}" in printed


def test_llama_perplexity_needs_a_gguf_file(tiny_folder, capsys):
    code = main(["bench", "quality", "--model", str(tiny_folder), "--window", "8",
                 "--llama-perplexity", "/nonexistent/llama-perplexity"])
    err = capsys.readouterr().err
    assert code == 1 and "runs a GGUF file" in err and err.count("\n") == 1
