"""`llmserve bench startup`'s parts that need no server: the first-start cache (models and
kernel libraries linked, no decisions), reading the choice from a start-up log, the table."""

from llmserve.bench import startup


def test_a_first_start_cache_links_models_and_libraries_but_no_decisions(tmp_path,
                                                                          monkeypatch):
    home = tmp_path / "home"
    (home / "smollm2-135m").mkdir(parents=True)
    (home / "kernels").mkdir()
    (home / "kernels" / "cpu_kernels-avx2-0123-4567-89ab.so").write_bytes(b"elf")
    (home / "kernels" / "choice-0123.json").write_text("{}")
    (home / "kernels" / "attention-0123.json").write_text("{}")
    (home / "weights").mkdir()  # kept packed weights: a first start loads the files
    (home / "weights" / "0123.pt").write_bytes(b"kept")
    monkeypatch.setenv("LLMSERVE_CACHE", str(home))
    cache = startup.first_start_cache(tmp_path / "first")
    assert (cache / "smollm2-135m").resolve() == home / "smollm2-135m"
    assert not (cache / "weights").exists()
    assert sorted(p.name for p in (cache / "kernels").iterdir()) == [
        "cpu_kernels-avx2-0123-4567-89ab.so"]


def test_the_choice_is_read_from_the_log():
    log = ("INFO native CPU kernels loaded: avx2 (CPU: avx2 fma f16c)\n"
           "WARNING auto runs int4: the machine was busy while timing (others used 1.8 of 2 "
           "cores): running the default for the checkpoint's format, int4; not cached")
    choice = startup.CHOICE_LINE.search(log).group(0)
    assert startup._format(choice) == "int4"
    assert startup.NATIVE_LINE.search(log).group(0) == "native CPU kernels loaded: avx2 (CPU: "\
        "avx2 fma f16c)"
    assert startup._format("auto runs int4-a8 (cached; ...)") == "int4-a8"


def test_the_table_has_a_row_per_start():
    row = {"model": "/x/llama-3.2-1b.Q4_0.gguf", "install": "wheel, no compiler",
           "first_start": "busy", "format": "int4", "first_start_s": 9.25, "warm_start_s": 2.5,
           "tok_s_1": 30.0, "tok_s_32": 61.5, "kernels": "native CPU kernels loaded: avx2",
           "choice": "auto runs int4 (measured; ...)"}
    text = startup.format_startup({"rows": [row]})
    assert "llama-3.2-1b.Q4_0.gguf" in text and "wheel, no compiler" in text
    assert "9.2" in text and "61.5" in text and "auto runs int4 (measured" in text


def test_a_busy_start_is_judged_against_the_quiet_one_run_by_run():
    quiet = {"model": "m", "install": "this", "first_start": "quiet", "format": "int4-a8",
             "first_start_s": 6.0, "warm_start_s": 2.6, "kernels": None, "choice": "c",
             "tok_s_1": 100.0, "tok_s_1_runs": [50.0, 90.0, 110.0],
             "tok_s_32": 250.0, "tok_s_32_runs": [100.0, 245.0, 255.0]}
    # run by run, 1 stream: 1.16x and 0.95x (either side of 1); 32 streams: 0.81x and 0.79x,
    # both below 1 and 20 % off, where the runs lie 4 % apart
    busy = quiet | {"first_start": "busy", "tok_s_1": 99.0, "tok_s_1_runs": [60.0, 104.0, 104.5],
                    "tok_s_32": 200.0, "tok_s_32_runs": [90.0, 199.0, 201.0]}
    # the first run is the fresh server's warm-up: neither the speed nor the noise
    assert startup.judged([50.0, 90.0, 110.0]) == [90.0, 110.0]
    assert startup.spread([50.0, 90.0, 110.0]) == 0.2
    one, many = startup.same_speed(quiet, busy)
    assert one == "1 stream 1.05x (runs 0.95-1.16x; runs' spread 20%): the same speed within noise"
    assert many.startswith("32 streams 0.80x (runs 0.79-0.81x; runs' spread 4%): **a different")
    text = startup.format_startup({"rows": [quiet, busy]})
    assert "m / this: same format; 1 stream 1.05x" in text
    other = busy | {"format": "float32"}
    assert "**another format** (int4-a8 vs float32)" in startup.format_startup(
        {"rows": [quiet, other]})
    once = {"tok_s_1_runs": [100.0], "tok_s_32_runs": [100.0], "tok_s_1": 100.0, "tok_s_32": 1.0}
    assert startup.same_speed(once, once)[0] == "1 stream 1.00x: too few runs for a verdict"
