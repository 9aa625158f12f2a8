"""Training an EAGLE-1 head: the trainer's layer is the published head's (transformers'
Llama layer as EAGLE uses it), the saved head loads with its draft vocabulary and the
proposer drafts, over the paged cache, exactly the chains the held-out figure counts; the
recipe learns a synthetic language it can learn; `llmserve train-heads --method eagle`
writes a head the engine drafts with losslessly."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve.config.model import ModelConfig
from llmserve.entrypoints.cli import main
from llmserve.layers.attention.selector import attention_backend
from llmserve.layers.kv_cache import KVCache
from llmserve.spec_decode.eagle import (
    EagleProposer,
    eagle_head_config,
    load_eagle_head,
    target_lm_head_rows,
)
from llmserve.spec_decode.eagle_training import (
    DraftVocabulary,
    EagleSequence,
    TrainableEagle,
    _batch,
    chain_drafts,
    chain_losses,
    draft_vocabulary,
    eagle_sequences,
    resume_eagle,
    save_eagle_head,
    train_eagle,
)
from llmserve.spec_decode.medusa import HeadsFormatError
from llmserve.spec_decode.training import Answer
from llmserve.worker.drafts import DraftSeed
from tests.spec_decode.test_eagle import reference_forward
from tests.spec_decode.test_train_heads import assert_drafts_losslessly, texts_file


def random_sequence(cfg, n: int, seed: int) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(100, 3000, (n,), generator=g).tolist(),
            torch.randn(n, cfg.hidden_size, generator=g))


def test_the_trainer_layer_is_the_published_head(float32_model):
    cfg = float32_model.config
    torch.manual_seed(0)
    head = TrainableEagle(cfg)
    tensors = {k: v.detach().clone() for k, v in head.state_dict().items()}
    assert set(tensors) >= {"fc.weight", "layers.0.self_attn.q_proj.weight",
                            "layers.0.post_attention_layernorm.weight",
                            "layers.0.mlp.down_proj.weight"}
    ids, features = random_sequence(cfg, 29, 1)
    with torch.inference_mode():
        embeds = float32_model.model.model.embed_tokens(torch.tensor(ids)).clone()
    want = reference_forward(tensors, cfg, embeds, features)
    with torch.no_grad():
        got = head(embeds[None], features[None])[0]
    assert (got - want).abs().max() < 2e-5


def test_the_proposer_drafts_the_chains_the_held_out_figure_counts(tmp_path, float32_model):
    """Chains from the trainer's evaluation (every position at once) equal the runtime
    proposer's, run over the paged KV cache from the saved head, at several positions."""
    cfg = float32_model.config
    torch.manual_seed(1)
    trainer = TrainableEagle(cfg)
    with torch.no_grad():  # a head whose drafts depend on the token and its context
        for p in trainer.parameters():
            p.mul_(8)
    tokens, hidden = random_sequence(cfg, 40, 2)
    with torch.inference_mode():  # tied: the LM head is the embedding
        lm_head = float32_model.model.model.embed_tokens(
            torch.arange(cfg.vocab_size)).float().clone()

    def embed(ids):
        return lm_head[torch.as_tensor(ids, dtype=torch.long)]

    answer = Answer(tokens, hidden, 5)
    # a vocabulary wider than the sequence's tokens, so chains can leave them
    vocabulary = draft_vocabulary([answer, Answer(list(range(4000, 4400)), hidden, 0)],
                                  lm_head, embed, 400)
    seq = eagle_sequences([answer], embed)[0]
    depth = 4
    drafts, right, chance = chain_drafts(trainer, vocabulary, seq, depth)
    assert chance.shape == drafts.shape and (chance[:, 1:] <= chance[:, :-1]).all()
    assert drafts.shape == (len(tokens) - 2 - seq.first, depth)
    assert right.shape == drafts.shape

    folder = save_eagle_head(trainer, vocabulary, cfg, tmp_path / "head")
    config = json.loads((folder / "config.json").read_text())
    assert config["draft_vocab_size"] == len(vocabulary.ids) == 400
    head = load_eagle_head(folder, float32_model, torch.device("cpu"), torch.float32,
                           int8=False)
    assert torch.equal(head.draft_ids, vocabulary.ids)
    block = 16
    kv_cache = KVCache.allocate(cfg.num_hidden_layers + 1, 8, block, cfg.num_key_value_heads,
                                cfg.head_dim, torch.float32, torch.device("cpu"), zeroed=True)
    proposer = EagleProposer(head, float32_model.model, kv_cache,
                             attention_backend(torch.device("cpu")), torch.device("cpu"))
    blocks = np.arange(8, dtype=np.int32)
    for p in (seq.first, 17, 30):
        seed = DraftSeed("r", tokens[: p + 2], depth, hidden[: p + 1], 0, blocks)
        got = proposer.propose([seed])[0]
        assert got == drafts[p - seq.first].tolist(), p


@pytest.mark.parametrize("path", ["float32", "default"])
def test_a_compact_head_is_its_full_head_on_the_engine(tmp_path, float32_model, default_model,
                                                       path):
    """`train-heads --compact`: int8 matrices with a scale per row and no LM head rows (the
    target's own, read back from its format: float32, or the default path's packed
    embedding) -- under a quarter of the bytes, and on the engine (which runs a head in
    int8) the same head: equal drafts, bit-equal K/V."""
    target = float32_model if path == "float32" else default_model
    cfg = target.config
    torch.manual_seed(3)
    trainer = TrainableEagle(cfg)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(8)
    ids = torch.arange(100, 1124)
    rows = target_lm_head_rows(target.model, ids)
    vocabulary = DraftVocabulary(ids, rows, rows)
    full = save_eagle_head(trainer, vocabulary, cfg, tmp_path / "full")
    compact = save_eagle_head(trainer, vocabulary, cfg, tmp_path / "compact", compact=True)
    assert "lm_head.weight" not in load_file(compact / "model.safetensors")
    assert (compact / "model.safetensors").stat().st_size * 4 < \
        (full / "model.safetensors").stat().st_size
    tokens, hidden = random_sequence(cfg, 40, 4)
    block, out = 16, []
    for folder in (full, compact):
        head = load_eagle_head(folder, target, torch.device("cpu"), torch.float32)
        kv_cache = KVCache.allocate(cfg.num_hidden_layers + 1, 8, block,
                                    cfg.num_key_value_heads, cfg.head_dim, torch.float32,
                                    torch.device("cpu"), zeroed=True)
        proposer = EagleProposer(head, target.model, kv_cache,
                                 attention_backend(torch.device("cpu")), torch.device("cpu"))
        proposer.min_confidence = 0.0
        seed = DraftSeed("r", tokens[:31], 4, hidden[:30], 0, np.arange(8, dtype=np.int32))
        out.append((proposer.propose([seed])[0], kv_cache.key[-1].clone(),
                    kv_cache.value[-1].clone()))
    assert len(out[0][0]) == 4 and out[0][0] == out[1][0]
    assert torch.equal(out[0][1], out[1][1]) and torch.equal(out[0][2], out[1][2])


@pytest.mark.parametrize(("change", "message"), [
    (lambda c, t: t.pop("d2t"), "draft_vocab_size 3 needs 'd2t'"),
    (lambda c, t: t.update(d2t=torch.tensor([0, 0, 60000])), "outside the vocabulary"),
    (lambda c, t: t.update(d2t=torch.tensor([1, 0, 0])), "two onto one token"),
    (lambda c, t: t.update(d2t=torch.zeros(3)), "d2t must be 3 integers"),
    (lambda c, t: c.update(draft_vocab_size=0), "draft_vocab_size must be a positive"),
    (lambda c, t: t.update({"lm_head.weight": torch.zeros(4, 576)}), "lm_head.weight has shape"),
])
def test_draft_vocabularies_that_do_not_fit_are_refused_by_name(tmp_path, float32_model,
                                                                change, message):
    cfg = float32_model.config
    torch.manual_seed(0)
    folder = tmp_path / "head"
    save_eagle_head(TrainableEagle(cfg), DraftVocabulary(
        torch.tensor([5, 7, 9]), torch.randn(3, cfg.hidden_size),
        torch.randn(3, cfg.hidden_size)), cfg, folder)
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    change(config, tensors)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(HeadsFormatError, match=message):
        load_eagle_head(folder, float32_model, torch.device("cpu"), torch.float32)


VOCAB, HIDDEN = 24, 32


def tiny_config() -> ModelConfig:
    return ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_hidden_layers": 2, "vocab_size": VOCAB, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 256})


@pytest.mark.parametrize(("unroll", "dtype"), [(1, torch.float32), (3, torch.float32),
                                              (3, torch.bfloat16)])
def test_the_recipe_learns_what_can_be_learnt(unroll, dtype):
    """A language where each token is the previous one plus 1 (mod V); the "target's"
    feature at p is its LM head row of the token it predicts, x[p + 1], scaled; EAGLE-1's
    recipe and the one that trains the chain's next steps from the head's own features,
    in float32 and with its products in bfloat16 (`--train-dtype`)."""
    g = torch.Generator().manual_seed(0)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=g)
    table = torch.randn(VOCAB, HIDDEN, generator=g)

    def embed(ids):
        return table[torch.as_tensor(ids, dtype=torch.long)]

    def answers(count, seed):
        r = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(count):
            start = int(torch.randint(VOCAB, (1,), generator=r))
            tokens = [(start + i) % VOCAB for i in range(20)]
            hidden = 0.5 * lm_head[torch.tensor(tokens[1:] + [(tokens[-1] + 1) % VOCAB])]
            out.append(Answer(tokens, hidden, 2))
        return out

    train, held_out = answers(40, 1), answers(8, 2)
    vocabulary = draft_vocabulary(train, lm_head, embed, 1000)
    assert len(vocabulary.ids) == VOCAB
    cfg = tiny_config()
    before = train_eagle(eagle_sequences(train, embed), eagle_sequences(held_out, embed), cfg,
                         vocabulary, steps=0, depth=3)
    assert before.held_out_tokens_per_round < 1.5
    result = train_eagle(eagle_sequences(train, embed), eagle_sequences(held_out, embed),
                         cfg, vocabulary, steps=300, batch_size=8, lr=1e-2, depth=3,
                         unroll=unroll, train_measured=eagle_sequences(train[:8], embed),
                         dtype=dtype)
    assert all(p.dtype == torch.float32 for p in result.head.parameters())
    assert result.held_out_tokens_per_round > 3.5  # of the most, 4
    assert result.held_out_accuracy[-1] > 0.8
    assert result.train_tokens_per_round > 3.5
    assert result.losses[-1] < result.losses[0] / 3
    assert result.held_out_positions == 8 * (20 - 2 - 1)


def test_a_batch_of_unequal_sequences_trains_as_each_alone(float32_model):
    """Each chain step's loss over a padded batch is its sequences' own losses weighted by
    their positions at that step: padding reaches no real position, at any step."""
    cfg = float32_model.config
    torch.manual_seed(3)
    head = TrainableEagle(cfg)
    g = torch.Generator().manual_seed(4)
    lm_head = torch.randn(300, cfg.hidden_size, generator=g)
    vocabulary = DraftVocabulary(torch.arange(300), lm_head, lm_head)
    seqs = [EagleSequence(*(torch.randn(n, cfg.hidden_size, generator=g) for _ in range(3)),
                          list(range(n + 1)), 0) for n in (9, 14)]
    with torch.no_grad():
        both = chain_losses(head, vocabulary, *_batch(seqs), unroll=3)
        alone = [chain_losses(head, vocabulary, *_batch([s]), unroll=3) for s in seqs]
    assert len(both) == 3
    for step in range(3):
        counts = [len(s.embeds) - step for s in seqs]
        want = sum(c * a[step] for c, a in zip(counts, alone, strict=True)) / sum(counts)
        assert abs(float(both[step]) - float(want)) < 1e-4, step


def test_train_heads_eagle_writes_a_head_the_engine_drafts_with(tmp_path, smollm2_gguf,
                                                                float32_model, capsys):
    data = texts_file(tmp_path)
    out, dataset = tmp_path / "eagle", tmp_path / "answers.safetensors"
    flags = ["train-heads", "--model", str(smollm2_gguf), "--output", str(out),
             "--method", "eagle", "--steps", "6", "--batch-size", "2",
             "--checkpoint-every", "4", "--held-out", "0.25", "--kv-cache-memory", "64MiB",
             "--num-heads", "3", "--draft-vocab", "50"]
    code = main([*flags, "--data", str(data), "--max-tokens", "16", "--samples", "2",
                 "--save-dataset", str(dataset)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "wrote an EAGLE head (50 draft tokens)" in printed and "tokens per round" in printed
    config = json.loads((out / "config.json").read_text())
    info = config["llmserve"]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 50
    assert config == eagle_head_config(float32_model.config, 1, 50) | {"llmserve": info}
    # 4 prompts, a greedy and a sampled answer each; one prompt's greedy answer measures
    assert info["method"] == "eagle" and info["answers"] == 8 and info["steps"] == 6
    assert info["held_out_positions"] > 0 and "checkpoint_step" not in info
    assert 1.0 <= info["held_out_tokens_per_round"] <= 4.0
    # the saved answers train the same head again, without generating
    weights = load_file(out / "model.safetensors")
    assert main([*flags, "--dataset", str(dataset)]) == 0
    again = json.loads((out / "config.json").read_text())["llmserve"]
    assert again["answers"] == 8 and again["seconds_generating"] == 0
    assert again["held_out_tokens_per_round"] == info["held_out_tokens_per_round"]
    for name, tensor in load_file(out / "model.safetensors").items():
        assert torch.equal(tensor, weights[name]), name
    assert_drafts_losslessly(float32_model, "eagle", out)
    # training goes on from that head (its vocabulary kept), written compact, on two
    # datasets' answers together
    more = tmp_path / "more"
    flags[flags.index(str(out))] = str(more)
    assert main([*flags, "--dataset", str(dataset), "--dataset", str(dataset), "--init",
                 str(out), "--compact"]) == 0
    info = json.loads((more / "config.json").read_text())["llmserve"]
    assert info["init"] == str(out) and info["draft_vocab_size"] == 50
    assert info["answers"] == 16 and info["data"].count(str(dataset)) == 2
    tensors = load_file(more / "model.safetensors")
    assert torch.equal(tensors["d2t"], weights["d2t"]) and "lm_head.weight" not in tensors
    assert tensors["fc.weight"].dtype == torch.int8
    assert_drafts_losslessly(float32_model, "eagle", more)


def test_a_saved_head_resumes_as_it_was_saved(tmp_path, float32_model):
    cfg = float32_model.config
    torch.manual_seed(5)
    trainer = TrainableEagle(cfg)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size)

    def embed(ids):
        return lm_head[torch.as_tensor(ids)] * 2

    ids = torch.tensor([3, 8, 900, 4000])
    vocabulary = DraftVocabulary(ids, lm_head[ids], embed(ids))
    for compact in (False, True):
        folder = save_eagle_head(trainer, vocabulary, cfg, tmp_path / str(compact),
                                 compact=compact)
        head, again = resume_eagle(folder, cfg, lm_head, embed)
        assert torch.equal(again.ids, ids) and torch.equal(again.lm_head, lm_head[ids])
        assert torch.equal(again.embeds, embed(ids))
        for name, tensor in trainer.state_dict().items():
            got = head.state_dict()[name]
            if compact and tensor.dim() == 2:  # int8 with a scale per row
                step = tensor.abs().amax(dim=1, keepdim=True) / 127
                assert ((got - tensor).abs() <= step / 2 + 1e-7).all(), name
            else:
                assert torch.equal(got, tensor), name
    with pytest.raises(HeadsFormatError, match="no draft vocabulary"):
        tensors = load_file(folder / "model.safetensors")
        del tensors["d2t"]
        save_file(tensors, folder / "model.safetensors")
        resume_eagle(folder, cfg, lm_head, embed)


def test_the_loss_counts_the_answers_not_the_prompts():
    """As EAGLE trains: the prompt feeds attention, the loss starts at its last position."""
    seqs = [EagleSequence(*(torch.zeros(n, 4) for _ in range(3)), list(range(n + 1)), first)
            for n, first in ((9, 3), (6, 0))]
    mask = _batch(seqs)[3]
    assert mask.tolist() == [[False] * 3 + [True] * 6, [True] * 6 + [False] * 3]
