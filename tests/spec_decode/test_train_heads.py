"""Training Medusa heads by self-distillation: the recipe learns a synthetic language it can
learn (its held-out acceptance figure measured right), and `llmserve train-heads` writes
heads, with how they were made, that the engine loads and drafts with losslessly."""

import json
from pathlib import Path

import pytest
import torch

from llmserve import SamplingParams
from llmserve.entrypoints.cli import main
from llmserve.spec_decode.training import (
    Answer,
    HiddenRecorder,
    evaluate,
    positions,
    split_held_out,
    train_medusa,
    training_dtype,
)
from tests.engines import llm_on

VOCAB, HIDDEN = 24, 32


def synthetic_answers(count: int, length: int, seed: int) -> list[Answer]:
    """A language where each token is the previous one plus 1 (mod V), and the "target's
    hidden state" at p is a fixed vector of the token it predicts, x[p + 1]."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
    answers = []
    for _ in range(count):
        start = int(torch.randint(VOCAB, (1,), generator=g))
        tokens = [(start + i) % VOCAB for i in range(length)]
        hidden = table[torch.tensor(tokens[1:] + [(tokens[-1] + 1) % VOCAB])]
        answers.append(Answer(tokens, hidden, 2))
    return answers


def test_positions_pair_each_hidden_state_with_the_tokens_after_the_next():
    answers = synthetic_answers(1, 8, 1)
    rows, labels = positions(answers, 3)
    tokens = answers[0].tokens
    assert len(rows) == 8 - 1 - 2  # from the prompt's last position to the third last
    assert torch.equal(rows[0], answers[0].hidden[1])
    assert labels[0].tolist() == tokens[3:6]
    assert labels[-1].tolist() == [tokens[7], -100, -100]


def test_the_recipe_learns_what_can_be_learnt():
    table = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
    train, held_out = synthetic_answers(40, 20, 1), synthetic_answers(8, 20, 2)
    before = train_medusa(train, held_out, table, num_heads=3, steps=0)
    assert before.held_out_tokens_per_round == pytest.approx(1.0, abs=0.2)
    result = train_medusa(train, held_out, table, num_heads=3, steps=300, batch_size=32,
                          lr=1e-2)
    assert result.held_out_tokens_per_round > 3.5  # of the most, 4
    assert min(result.held_out_accuracy) > 0.9
    assert result.losses[-1] < result.losses[0] / 5
    rows, labels = positions(held_out, 3)
    assert evaluate(result.heads, rows, labels)[0] == result.held_out_tokens_per_round


def texts_file(folder: Path) -> Path:
    """Four short paragraphs for `--data`."""
    data = folder / "texts.txt"
    data.write_text("The river runs past the mill and down to the sea.\n\n"
                    "One, two, three, four, five, six, seven, eight, nine, ten.\n\n"
                    "Monday, Tuesday, Wednesday, Thursday, Friday.\n\n"
                    "A B C D E F G H I J K L M N O P.\n")
    return data


def test_train_heads_command_writes_heads_the_engine_drafts_with(tmp_path, smollm2_gguf,
                                                                  float32_model, capsys):
    data = texts_file(tmp_path)
    out = tmp_path / "heads"
    code = main(["train-heads", "--model", str(smollm2_gguf), "--output", str(out),
                 "--data", str(data), "--max-tokens", "16", "--steps", "12",
                 "--batch-size", "16", "--checkpoint-every", "5", "--held-out", "0.25",
                 "--kv-cache-memory", "64MiB", "--num-heads", "3"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "wrote 3 Medusa heads" in printed and "tokens per round" in printed
    config = json.loads((out / "config.json").read_text())
    info = config["llmserve"]
    assert config["num_heads"] == 3 and config["original_lm_head"] is True
    assert info["answers"] == 4 and info["held_out_positions"] > 0
    assert info["steps"] == 12 and "checkpoint_step" not in info
    assert 1.0 <= info["held_out_tokens_per_round"] <= 4.0
    assert (out / "model.safetensors").stat().st_size < 4 * 2**20  # blocks only
    # the engine drafts with them, and the output is the target's own
    assert_drafts_losslessly(float32_model, "medusa", out)


def assert_drafts_losslessly(float32_model, method: str, folder: Path) -> None:
    """The engine drafts with the heads in `folder`, and its greedy output is the
    target's own."""
    prompts = ["Count to ten: one, two, three,", "The days of the week are"]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    want = llm_on(float32_model, kv_cache_memory="64MiB").generate(prompts, greedy,
                                                                   use_tqdm=False)
    llm = llm_on(float32_model, kv_cache_memory="64MiB", speculative_config={
        "method": method, "model": str(folder), "num_speculative_tokens": 3,
        "adaptive": False, "disable_by_batch_size": None})
    got = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.speculator.stats.num_draft_tokens > 0


def test_train_heads_refuses_bad_flags(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train-heads", "--output", str(tmp_path), "--steps", "0"])
    assert "--steps must be at least 1" in capsys.readouterr().err


def test_the_target_writes_its_own_prompts(default_model):
    """--self-prompts: the model, given its chat template up to the user's turn, writes
    distinct finished prompts; the same seed writes the same ones."""
    from llmserve.entrypoints.cli.train_heads import self_prompts

    llm = llm_on(default_model, kv_cache_memory="64MiB")
    prompts = self_prompts(llm, 12, 1.0, seed=3)
    assert len(prompts) == len(set(prompts)) == 12
    assert all(len(p) >= 8 and p == p.strip() and "<|im_" not in p for p in prompts)
    assert self_prompts(llm, 12, 1.0, seed=3) == prompts
    assert self_prompts(llm, 12, 1.0, seed=4) != prompts


def test_each_seed_samples_prompts_of_its_own():
    """--self-prompts' samples for a seed, a try and an opening take seeds run + 0, + 1,
    ...: the runs of seeds 0-3 (4 tries, 16 openings, up to 65,536 samples each) never
    share one."""
    from llmserve.entrypoints.cli.train_heads import prompt_run_seed

    starts = sorted(prompt_run_seed(seed, attempt, opening) for seed in range(4)
                    for attempt in range(4) for opening in range(16))
    assert all(b - a >= 2**16 for a, b in zip(starts, starts[1:], strict=False))
    assert starts[-1] < 2**63


def test_a_prompt_two_datasets_share_is_held_out_in_both_or_neither():
    """The held-out prompts are picked by their tokens, not their numbers in a file: the
    same prompt under other numbers (a second dataset) falls on the same side, with its
    sampled answers; a share of the distinct prompts is held out, its greedy answers
    measured."""
    hidden = torch.zeros(6, HIDDEN)
    first = [Answer([p, p + 1, 7, 8, 9, 10], hidden, 2, prompt=p) for p in range(20)]
    second = [Answer([p, p + 1, 7, 8, 9, 10], hidden, 2, prompt=p + 1) for p in range(20)]
    sampled = [Answer([p, p + 1, 7, 8, 9, 11], hidden, 2, prompt=p, sampled=True)
               for p in range(20)]
    train, held = split_held_out(first + second + sampled, 0.25)
    held_prompts = {tuple(a.tokens[:2]) for a in held}
    assert len(held_prompts) == 5 and len(held) == 10 and not any(a.sampled for a in held)
    assert not held_prompts & {tuple(a.tokens[:2]) for a in train}
    assert len(train) == 60 - 10 - 5  # the held-out prompts' sampled answers are not trained
    everything, none = split_held_out(first, 0.0)
    assert none == [] and len(everything) == 20
    assert all(a is b for a, b in zip(everything, first, strict=True))


def test_self_prompts_go_with_generating_only(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train-heads", "--output", str(tmp_path), "--self-prompts", "8",
              "--data", str(texts_file(tmp_path))])
    assert "--self-prompts adds to the built-in prompts" in capsys.readouterr().err


def test_the_answers_hidden_states_are_the_targets_own(tmp_path, float32_model):
    """`train-heads` takes the hidden states while the target answers (chunked prompts,
    a batch of greedy and sampled answers): each answer's rows are those of one forward
    over its tokens, and it ends at the last token the target was fed."""
    import argparse

    from llmserve.bench.quality import full_hidden_states
    from llmserve.entrypoints.cli.train_heads import _answers

    llm = llm_on(float32_model, kv_cache_memory="64MiB", enable_prefix_caching=False,
                 max_num_batched_tokens=16)
    args = argparse.Namespace(data=texts_file(tmp_path), samples=2, temperature=0.8, seed=0,
                              max_tokens=10, max_prompt_tokens=512, self_prompts=0,
                              dtype="float32")
    source, answers, _ = _answers(llm, args)
    assert len(answers) == 8 and [a.sampled for a in answers] == [False] * 4 + [True] * 4
    greedy = llm.generate(["The river runs past the mill and down to the sea."],
                          SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert answers[0].tokens == (greedy.prompt_token_ids
                                 + greedy.outputs[0].token_ids[:-1])
    for a in answers:
        assert len(a.hidden) == len(a.tokens) > a.first
        torch.testing.assert_close(a.hidden, full_hidden_states(llm, a.tokens).float(),
                                   atol=2e-4, rtol=1e-3)
    assert llm.engine.executor.runner.proposer is None  # the recorder is gone


def test_the_recorder_refuses_a_position_never_computed():
    from llmserve.worker.drafts import DraftSeed

    recorder = HiddenRecorder()
    rows = torch.arange(12.0).view(6, 2)
    recorder.propose([DraftSeed("a", [], 0, rows[:4], 0), DraftSeed("b", [], 0, rows[:2], 0)])
    recorder.propose([DraftSeed("a", [], 0, rows[4:5], 4), DraftSeed("b", [], 0, rows[3:4], 3)])
    assert torch.equal(recorder.take("a", 5), rows[:5])
    with pytest.raises(ValueError, match="position 2"):
        recorder.take("b", 4)


def test_bfloat16_training_goes_where_the_cpu_has_it(monkeypatch):
    import llmserve.cpu_info

    assert training_dtype("float32") == torch.float32
    assert training_dtype("bfloat16") == torch.bfloat16
    for flags, want in (({"avx2", "amx_bf16"}, torch.bfloat16),
                        ({"avx512f", "avx512_bf16"}, torch.bfloat16),
                        ({"avx2", "fma"}, torch.float32)):
        monkeypatch.setattr(llmserve.cpu_info, "cpu_features", lambda f=flags: frozenset(f))
        assert training_dtype("auto") == want
