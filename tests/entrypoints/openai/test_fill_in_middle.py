"""Fill-in-the-middle: `suffix` on /v1/completions and Ollama's /api/generate (what editor
plugins send) lays the text before and after the hole around the vocabulary's FIM tokens;
the answer is the one the same token ids get as a prompt. A tiny model made here has the
tokens; the default model, which has none, refuses `suffix` by name
(test_bad_input, test_ollama)."""

import json

import httpx
import pytest

from llmserve.tokenizer import Tokenizer
from tests.cli_server import cli_server
from tests.tiny_models import save_tiny

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """A tiny Llama whose byte-level vocabulary has Qwen2.5-Coder's FIM tokens (256-258)."""
    import transformers
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    folder = tmp_path_factory.mktemp("coder")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=260,
                                      max_position_embeddings=512)
    save_tiny(transformers.LlamaForCausalLM(config), folder)
    tokenizer = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in FIM])
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_the_prompt_is_prefix_suffix_middle(coder):
    tokenizer = Tokenizer.from_hf_folder(coder)
    assert tokenizer.fill_in_middle_ids == (256, 257, 258)
    ids = tokenizer.encode_fill_in_middle(PREFIX, SUFFIX)
    assert ids == [256, *tokenizer.encode(PREFIX, False), 257, *tokenizer.encode(SUFFIX, False),
                   258]


def test_a_model_without_the_tokens_has_no_fill_in_middle(tmp_path):
    import transformers

    save_tiny(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256)), tmp_path)
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert tokenizer.fill_in_middle_ids is None
    with pytest.raises(ValueError, match="fill-in-the-middle"):
        tokenizer.encode_fill_in_middle("a", "b")


def test_suffix_completes_between_on_both_apis(coder):
    ids = Tokenizer.from_hf_folder(coder).encode_fill_in_middle(PREFIX, SUFFIX)
    greedy = {"max_tokens": 8, "temperature": 0}
    args = ["--model", str(coder), "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--port", "0"]
    with cli_server(args) as (_, url), httpx.Client(base_url=url.removesuffix("/v1"),
                                                    timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        filled = http.post("/v1/completions", json={"model": model, "prompt": PREFIX,
                                                    "suffix": SUFFIX, **greedy})
        assert filled.status_code == 200, filled.text
        as_ids = http.post("/v1/completions", json={"model": model, "prompt": ids, **greedy})
        text = as_ids.json()["choices"][0]["text"]
        assert filled.json()["choices"][0]["text"] == text
        assert filled.json()["usage"]["prompt_tokens"] == len(ids)

        ollama = http.post("/api/generate", json={
            "model": model, "prompt": PREFIX, "suffix": SUFFIX, "stream": False,
            "options": {"temperature": 0, "num_predict": 8}})
        assert ollama.status_code == 200, ollama.text
        assert ollama.json()["response"] == text
        assert ollama.json()["context"][:len(ids)] == ids
        streamed = http.post("/api/generate", json={
            "model": model, "prompt": PREFIX, "suffix": SUFFIX,
            "options": {"temperature": 0, "num_predict": 8}})
        lines = [json.loads(line) for line in streamed.text.splitlines()]
        assert "".join(line["response"] for line in lines) == text
        show = http.post("/api/show", json={"model": model}).json()
        assert "insert" in show["capabilities"]

        for body, field in (({"prompt": [1, 2], "suffix": "x"}, "suffix"),
                            ({"prompt": "a", "suffix": "x", "echo": True}, "echo")):
            refused = http.post("/v1/completions", json={"model": model, **body})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field
        for extra in ({"system": "be brief"}, {"context": [1, 2]}):
            name = next(iter(extra))
            refused = http.post("/api/generate", json={"model": model, "prompt": "a",
                                                       "suffix": "b", **extra})
            assert refused.status_code == 400 and name in refused.json()["error"]
