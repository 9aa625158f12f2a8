"""Engines of their own on the suite's shared weights (tests/conftest.py loads each kind once)."""


def engine_on(loaded, **options):
    """An engine of its own on weights already loaded (`float32_model`, `default_model`,
    ...); `options` are `EngineConfig`'s, the dtype follows the weights."""
    from llmserve.config.engine import EngineConfig
    from llmserve.engine.engine import Engine

    options.setdefault("dtype", "auto" if loaded.quantization else "float32")
    return Engine(EngineConfig(model=str(loaded.source.path), **options), loaded=loaded)


def llm_on(loaded, **options):
    """`LLM` over `engine_on(loaded, **options)`."""
    from llmserve import LLM

    return LLM.from_engine(engine_on(loaded, **options))
