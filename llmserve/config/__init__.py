"""Frozen, validated configuration: a model's shape (`model.py`), how an engine runs it
(`engine.py`), and where llmserve keeps its files (`paths.py`)."""
