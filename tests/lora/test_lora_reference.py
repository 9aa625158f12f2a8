"""LoRA adapters against `peft` on the same weights: float32 logits within 1e-3 and greedy
tokens equal for one adapter; a batch mixing three adapters and the base model equals each
run alone; the prefix cache keeps an adapter's blocks apart; what does not fit is refused."""

import json

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.engine.input_processor import RequestRejected
from tests.lora.adapters import base_folder, lora, make_adapter
from tests.models.test_llama_reference import LOGIT_TOLERANCE, full_logits, reference_greedy

NUM_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A base folder, three adapters on it (all linears; attention only with rsLoRA; the
    MLP only, rank 4) and their PEFT references."""
    root = tmp_path_factory.mktemp("lora")
    base = base_folder(root / "base")
    specs = [dict(seed=1), dict(seed=2, targets=["q_proj", "v_proj", "o_proj"], rslora=True),
             dict(seed=3, rank=4, targets=["gate_proj", "up_proj", "down_proj"])]
    adapters, references = [], []
    for i, spec in enumerate(specs):
        folder = root / f"adapter{i}"
        references.append(make_adapter(base, folder, **spec))
        adapters.append(lora(folder, f"adapter{i}", i + 1))
    llm = LLM(str(root / "base"), dtype="float32", kv_cache_memory="16MiB", enable_lora=True,
              max_loras=4, max_lora_rank=8)
    return base, adapters, references, llm


def prompts() -> list[list[int]]:
    return [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in (21, 34, 40)]


def tokens(llm: LLM, batch: list, loras) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False,
                           lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_logits_and_greedy_tokens_equal_peft(setup, index):
    _, adapters, references, llm = setup
    ids = prompts()[2]
    llm.engine.lora.get(adapters[index])
    llm.engine.lora.begin_step(torch.full((len(ids),), index + 1).numpy())
    try:
        ours = full_logits(llm.engine.loaded.model, ids)
    finally:
        llm.engine.lora.end_step()
    with torch.inference_mode():
        ref = references[index](torch.tensor([ids])).logits[0]
    diff = (ours - ref).abs().max().item()
    print(f"adapter {index}: max |logit diff| vs peft = {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE
    expected = [reference_greedy(references[index], p, NUM_TOKENS) for p in prompts()]
    assert tokens(llm, prompts(), adapters[index]) == expected


def test_a_mixed_batch_equals_each_request_alone(setup):
    base, adapters, references, llm = setup
    batch = [p for p in prompts() for _ in range(4)]  # each prompt with each adapter and none
    loras = [a for _ in prompts() for a in [*adapters, None]]
    mixed = tokens(llm, batch, loras)
    alone = [tokens(llm, [p], a)[0] for p, a in zip(batch, loras, strict=True)]
    assert mixed == alone
    assert mixed[3] == [reference_greedy(base, batch[3], NUM_TOKENS)][0]  # the base model's
    assert len({tuple(t) for t in mixed[:4]}) == 4  # the adapters do change the output


def test_prefix_cache_keeps_adapters_apart(setup):
    """A prompt cached under one adapter is not a hit under another or the base model."""
    _, adapters, _, llm = setup
    ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(99)).tolist()
    prompt = {"prompt_token_ids": ids}  # seen by no other test

    def run(adapter):
        return llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapter)[0]

    first, again = run(adapters[0]), run(adapters[0])
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 48)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    assert run(adapters[1]).num_cached_tokens == 0
    assert run(None).num_cached_tokens == 0
    assert run(adapters[1]).num_cached_tokens == 48


def test_adapters_that_do_not_fit_are_refused_by_name(setup, tmp_path):
    base, adapters, _, llm = setup
    big = make_adapter(base, tmp_path / "big", seed=4, rank=16)
    assert big is not None
    with pytest.raises(RequestRejected, match="rank 16 exceeds max_lora_rank 8"):
        llm.generate("x", GREEDY, use_tqdm=False, lora_request=lora(tmp_path / "big", "big", 9))
    config = json.loads((tmp_path / "big" / "adapter_config.json").read_text())
    (tmp_path / "big" / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    with pytest.raises(RequestRejected, match="use_dora"):
        llm.generate("x", GREEDY, use_tqdm=False, lora_request=lora(tmp_path / "big", "d", 10))
    plain = LLM(str(adapters[0].lora_path).replace("adapter0", "base"), dtype="float32",
                kv_cache_memory="16MiB")
    with pytest.raises(RequestRejected, match="enable_lora"):
        plain.generate("x", GREEDY, use_tqdm=False, lora_request=adapters[0])


def test_native_updates_equal_the_torch_ops(setup, monkeypatch):
    """One native call a linear (`kernels/lora.cpp`) gives the torch ops' bits, for a step
    mixing three adapters and the base model."""
    from llmserve.lora.manager import LoRAStep

    _, adapters, _, llm = setup
    manager, model = llm.engine.lora, llm.engine.loaded.model
    for adapter in adapters:
        manager.get(adapter)
    ids = prompts()[2]
    slots = torch.tensor([i % 4 for i in range(len(ids))]).numpy()  # 0: the base model
    logits = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(LoRAStep, "native", lambda self, path: None)
        manager.begin_step(slots)
        try:
            logits.append(full_logits(model, ids))
        finally:
            manager.end_step()
    assert torch.equal(logits[0], logits[1])


def test_adapters_on_experts_are_refused(tmp_path):
    """An expert runs on its own rows of a step, so an adapter on one is refused by name
    (its attention linears would be taken)."""
    from safetensors.torch import save_file

    from tests.models.test_moe_reference import tiny_moe
    from tests.tiny_models import save_tiny

    save_tiny(tiny_moe("qwen3_moe"), tmp_path / "moe")
    folder = tmp_path / "expert-adapter"
    folder.mkdir()
    prefix = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(4, 64),
               f"{prefix}.lora_B.weight": torch.zeros(32, 4)},
              folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    llm = LLM(str(tmp_path / "moe"), dtype="float32", kv_cache_memory="16MiB",
              enable_lora=True)
    with pytest.raises(RequestRejected, match="mixture-of-experts expert"):
        llm.generate("x", GREEDY, use_tqdm=False, lora_request=lora(folder, "e", 1))
