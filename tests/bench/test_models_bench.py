"""`llmserve bench models`' parts that need no server: the folder of links, the routed vs
alone comparison run by run, the table; a whole run is `test_multi_model`'s server's."""

import pytest

from llmserve.bench import models
from llmserve.errors import LLMServeError


def test_the_folder_links_each_model_under_the_name_the_server_gives_it(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "a.Q4_0.gguf").write_bytes(b"gguf")
    (source / "folder-model").mkdir()
    root = tmp_path / "dir"
    root.mkdir()
    names = models.models_folder([source / "a.Q4_0.gguf", source / "folder-model"], root)
    assert names == ["a.Q4_0", "folder-model"]
    assert (root / "a.Q4_0.gguf").resolve() == source / "a.Q4_0.gguf"
    with pytest.raises(LLMServeError, match="two models"):
        models.models_folder([source / "a.Q4_0.gguf"], root)


def test_routed_is_set_against_alone_run_by_run():
    alone = [{"ttft_p50_ms": 100.0, "tok_s": 50.0}, {"ttft_p50_ms": 200.0, "tok_s": 40.0}]
    routed = [{"ttft_p50_ms": 110.0, "tok_s": 49.0}, {"ttft_p50_ms": 200.0, "tok_s": 44.0}]
    compared = models._compared(alone, routed)
    assert compared["ttft_p50_ms"]["ratios"] == pytest.approx([1.1, 1.0])
    assert compared["ttft_p50_ms"]["ratio"] == pytest.approx(1.05)
    assert compared["tok_s"]["alone"] == 45.0 and compared["tok_s"]["routed"] == 46.5
    assert compared["tok_s"]["ratios"] == pytest.approx([0.98, 1.1])


def test_the_table_names_each_cold_start_and_each_ratio():
    row = models._compared([{"ttft_p50_ms": 100.0, "tok_s": 50.0}],
                           [{"ttft_p50_ms": 103.0, "tok_s": 49.0}])
    report = {"config": {"names": ["m1", "m2"], "repeats": 1},
              "cold_first_token_s": {"m1": 5.5, "m2": 7.25},
              "routing": {"1": row, "16": row}}
    text = models.format_models_bench(report)
    assert "m1" in text and "5.50 s" in text and "7.25 s" in text
    assert "1.030" in text and "0.980" in text
    with pytest.raises(ValueError, match="--model"):
        models.ModelsBenchConfig(models=())
