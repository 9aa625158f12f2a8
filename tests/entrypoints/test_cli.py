"""The `llmserve` CLI end to end, as a user runs it: a subprocess on the real default model.

Each model-loading case is one subprocess (a few seconds each); the cases that read no
weights (metadata, user errors) call the same `main` in this process. A small KV budget
keeps start-up short.
"""

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

MODEL = ["--model", "smollm2-135m"]
SMALL_KV = ["--kv-cache-memory", "64MiB"]
GREEDY = ["--temperature", "0"]


def run_cli(
    *args: str, stdin: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmserve.entrypoints.cli", *args],
        input=stdin, capture_output=True, text=True, timeout=timeout,
    )


def run_cli_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """The CLI's `main` in this process, for commands that read no weights (metadata, user
    errors): what a subprocess would give, without a second interpreter importing torch."""
    from llmserve.entrypoints.cli import main

    capsys.readouterr()
    try:
        returncode = main(list(args))
    except SystemExit as e:  # argparse's usage errors
        returncode = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["llmserve", *args], returncode, out, err)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ---- commands that run the model ----------------------------------------------------------


def test_generate_prompt_streams_greedy_text():
    proc = run_cli("generate", *MODEL, *SMALL_KV, *GREEDY, "--max-tokens", "8",
                   "--prompt", "The capital of France is")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_generate_jsonl_writes_one_line_per_input_in_order(tmp_path):
    rows = [
        {"id": "first", "prompt": "The capital of France is", "max_tokens": 4},
        {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6},
        {"prompt_token_ids": [504, 3458, 282], "max_tokens": 3, "temperature": 0.8, "seed": 1},
    ]
    src, dst = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    proc = run_cli("generate", *MODEL, *SMALL_KV, *GREEDY, "--input", str(src),
                   "--output", str(dst))
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["index"] for r in results] == [0, 1, 2]
    fields = {"index", "prompt", "text", "token_ids", "finish_reason", "num_prompt_tokens",
              "num_output_tokens"}
    for row, result in zip(rows, results, strict=True):
        assert fields <= set(result)
        assert result["num_output_tokens"] == len(result["token_ids"]) <= row["max_tokens"]
        assert result["finish_reason"] in ("stop", "length")
    assert results[0]["id"] == "first" and "id" not in results[1]
    assert results[0]["prompt"] == rows[0]["prompt"] and "Paris" in results[0]["text"]
    assert "<|im_start|>user\nSay hi" in results[1]["prompt"]
    assert results[2]["prompt"] is None and results[2]["num_prompt_tokens"] == 3


def test_chat_reads_turns_from_stdin():
    proc = run_cli("chat", *MODEL, *SMALL_KV, "--max-tokens", "8", "--seed", "0",
                   stdin="Hello\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_bench_throughput_compares_static_batching(tmp_path):
    """Continuous then static batching on the same engine, with random output lengths: the
    same lengths in both runs (the tokens generated match), the policy restored after; the
    JSON's rates are its counts over its time."""
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "throughput", *MODEL, *SMALL_KV, "--num-prompts", "6",
                   "--input-len", "8", "--output-len", "6", "--random-output-len",
                   "--max-num-seqs", "2", "--compare-static", "--output-json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "requests" in proc.stdout and "out tok/s" in proc.stdout
    assert "batched / static output throughput" in proc.stdout
    report = json.loads(out.read_text())
    batched, static = report["runs"]
    assert (batched["mode"], static["mode"]) == ("batched", "static")
    for run in (batched, static):
        assert run["num_requests"] == 6 and run["num_prompt_tokens"] == 6 * 8
        elapsed = run["elapsed_s"]
        assert run["output_tokens_per_s"] == pytest.approx(run["num_output_tokens"] / elapsed)
        assert run["requests_per_s"] == pytest.approx(6 / elapsed)
        assert run["total_tokens_per_s"] == pytest.approx(
            (run["num_prompt_tokens"] + run["num_output_tokens"]) / elapsed)
    assert batched["num_output_tokens"] == static["num_output_tokens"]
    assert batched["num_output_tokens"] != 6 * 6  # the lengths vary (seed 0)
    assert report["scheduling_policy"] == "fcfs"
    assert report["batched_over_static"] == pytest.approx(
        batched["output_tokens_per_s"] / static["output_tokens_per_s"])


def test_output_lens_random_but_seeded():
    from llmserve.bench.throughput import output_lens

    lengths = output_lens(200, 16, True, seed=3)
    assert lengths == output_lens(200, 16, True, seed=3)
    assert min(lengths) >= 1 and max(lengths) <= 31 and len(set(lengths)) > 10
    assert output_lens(5, 16, False, seed=3) == [16] * 5


# ---- commands that only read metadata ----------------------------------------------------


def test_memory_shows_kv_bytes_per_token(capsys):
    proc = run_cli_here(capsys, "memory", *MODEL, "--dtype", "float32", "--batch", "4",
                        "--seq-len", "1024")
    assert proc.returncode == 0, proc.stderr
    # SmolLM2-135M: 2 x 30 layers x 3 KV heads x 64 head_dim x 4 bytes = 46,080 bytes
    assert "2 x 30 layers x 3 kv_heads x 64 head_dim x 4 bytes (float32) = 46,080 bytes" in (
        proc.stdout)
    assert "4 x 1024 tokens = 4,096 tokens" in proc.stdout


def test_models_lists_the_catalog():
    proc = run_cli("models")
    assert proc.returncode == 0, proc.stderr
    assert "smollm2-135m" in proc.stdout and "Apache-2.0" in proc.stdout


# ---- user errors -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, smollm2_gguf) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bad_models")
    truncated = folder / "truncated.gguf"
    with open(smollm2_gguf, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    rwkv = folder / "rwkv.gguf"
    writer = gguf.GGUFWriter(rwkv, "rwkv6")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"truncated": truncated, "rwkv": rwkv}


@pytest.mark.parametrize(
    ("model", "needles"),
    [
        ("/nonexistent/x.gguf", ("not found", "/nonexistent/x.gguf")),
        ("truncated", ("truncated.gguf", "truncated")),
        ("no-such-model", ("unknown model 'no-such-model'",)),
        ("rwkv", ("unsupported", "rwkv6")),
    ],
)
def test_bad_model_is_a_one_line_error(bad_models, model, needles, capsys):
    spec = str(bad_models.get(model, model))
    proc = run_cli_here(capsys, "generate", "--model", spec, "--prompt", "hi", "--max-tokens", "2")
    assert_one_line_error(proc, *needles)


def test_bad_sampling_flag_is_a_one_line_error(capsys):
    proc = run_cli_here(capsys, "generate", *MODEL, "--temperature", "-1", "--prompt", "hi")
    assert_one_line_error(proc, "temperature")


def test_malformed_jsonl_line_names_the_line(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "fine"}\n{"prompt": \n')
    proc = run_cli_here(capsys, "generate", *MODEL, "--input", str(src), "--output",
                        str(tmp_path / "o"))
    assert_one_line_error(proc, "line 2", "not valid JSON")


def test_bad_jsonl_sampling_override_names_the_line(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b", "top_p": 2}])
    proc = run_cli_here(capsys, "generate", *MODEL, "--input", str(src), "--output",
                        str(tmp_path / "o"))
    assert_one_line_error(proc, "line 2", "top_p")


def test_usage_error_exits_2(tmp_path, capsys):
    proc = run_cli_here(capsys, "generate", "--input", str(tmp_path / "in.jsonl"))
    assert proc.returncode == 2
    assert "--input needs --output" in proc.stderr and "Traceback" not in proc.stderr


def test_the_parser_imports_no_torch_nor_ray():
    """Every subcommand's flags are built at each start: the modules they come from stay
    light (`llmserve --help` answers in well under a second; a command imports torch, or
    Ray, when it runs)."""
    code = ("import sys; from llmserve.entrypoints.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
