"""LoRA over HTTP, with the openai SDK and raw requests: `--lora-modules` at start, the
request's `model` naming an adapter, `/v1/models` listing adapters under their base,
adapters loaded and unloaded through `/v1/load_lora_adapter` / `/v1/unload_lora_adapter`
(behind the API key) while requests run, and no output changed for the others."""

import threading

import httpx
import openai
import pytest

from llmserve import LLM, SamplingParams
from tests.entrypoints.openai.conftest import MODEL, run_server
from tests.lora.adapters import base_folder, lora, make_adapter

KEY = "lora-key"
PROMPT = "The lighthouse keeper opened the bottle and read"
LONG = 200  # tokens of the streams that run while adapters come and go


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = base_folder(root / "base")
    paths = []
    for i in range(3):
        make_adapter(base, root / f"a{i}", seed=10 + i)
        paths.append(root / f"a{i}")
    make_adapter(base, root / "too-big", seed=20, rank=32)
    return root, paths


@pytest.fixture(scope="module")
def offline(folders):
    """What each adapter (and the base) writes for PROMPT, greedy, offline."""
    root, paths = folders
    llm = LLM(str(root / "base"), dtype="float32", kv_cache_memory="16MiB", enable_lora=True,
              max_loras=4)
    params = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
    texts = {}
    for name, adapter in [("base", None)] + [(f"a{i}", lora(p, f"a{i}", i + 1))
                                              for i, p in enumerate(paths)]:
        texts[name] = llm.generate(PROMPT, params, use_tqdm=False,
                                   lora_request=adapter)[0].outputs[0].text
    assert len(set(texts.values())) == 4
    return texts


def complete(client: openai.OpenAI, model: str, max_tokens: int = LONG) -> str:
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert response.model == model  # an adapter's answer names the adapter
    return response.choices[0].text


def test_adapters_over_http(folders, offline):
    root, paths = folders
    options = {"enable_lora": True, "max_loras": 4, "kv_cache_memory": "16MiB",
               "max_model_len": 256}
    with run_server(root / "base", None, engine_options=options, api_key=KEY,
                    lora_modules=(("a0", str(paths[0])),)) as server:
        client = server.client(api_key=KEY)
        auth = {"Authorization": f"Bearer {KEY}"}
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {MODEL, "a0"} and models["a0"].parent == MODEL
        assert complete(client, "a0") == offline["a0"]
        assert complete(client, MODEL) == offline["base"]

        # a0 and the base model stream while a1 is loaded, used, and a0 unloaded
        results: dict[str, str] = {}

        def stream(model: str) -> None:
            chunks = client.completions.create(model=model, prompt=PROMPT, max_tokens=LONG,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            results[model] = "".join(c.choices[0].text for c in chunks if c.choices)

        threads = [threading.Thread(target=stream, args=(m,)) for m in ("a0", MODEL)]
        for t in threads:
            t.start()
        with httpx.Client(base_url=server.url, timeout=60) as http:
            refused = http.post("/v1/load_lora_adapter",
                                json={"lora_name": "a1", "lora_path": str(paths[1])})
            assert refused.status_code == 401  # behind the API key
            loaded = http.post("/v1/load_lora_adapter", headers=auth,
                               json={"lora_name": "a1", "lora_path": str(paths[1])})
            assert loaded.status_code == 200, loaded.text
            gone = http.post("/v1/unload_lora_adapter", headers=auth, json={"lora_name": "a0"})
            assert gone.status_code == 200, gone.text
            assert threads[0].is_alive()  # a0's stream was still running when a0 went
            assert complete(client, "a1") == offline["a1"]
            for t in threads:
                t.join(120)
            assert results == {"a0": offline["a0"], MODEL: offline["base"]}
            with pytest.raises(openai.NotFoundError, match="a0"):
                complete(client, "a0")
            big = http.post("/v1/load_lora_adapter", headers=auth,
                            json={"lora_name": "big", "lora_path": str(root / "too-big")})
            assert big.status_code == 400
            assert "rank 32 exceeds max_lora_rank 16" in big.json()["error"]["message"]
            assert big.json()["error"]["param"] == "lora_path"
            again = http.post("/v1/load_lora_adapter", headers=auth,
                              json={"lora_name": "a1", "lora_path": str(paths[2])})
            assert again.status_code == 400 and "already been loaded" in again.text
            missing = http.post("/v1/unload_lora_adapter", headers=auth,
                                json={"lora_name": "nope"})
            assert missing.status_code == 404
            for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                # a lone surrogate, as JSON can spell it: a 400 naming the field (was a 500)
                body = '{"lora_name": "\\ud800", "lora_path": "x"}'
                if route.endswith("unload_lora_adapter"):
                    body = '{"lora_name": "\\ud800"}'
                lone = http.post(route, headers={**auth, "content-type": "application/json"},
                                 content=body)
                assert lone.status_code == 400 and "lora_name" in lone.text, lone.text
        assert {m.id for m in client.models.list().data} == {MODEL, "a1"}


def test_a_server_without_lora_refuses_the_routes_and_adapter_names(folders):
    root, _ = folders
    with run_server(root / "base", None, engine_options={"kv_cache_memory": "16MiB",
                                                         "max_model_len": 256}) as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.post("/v1/load_lora_adapter", json={"lora_name": "x",
                                                            "lora_path": "/x"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            complete(server.client(), "a0", max_tokens=2)
