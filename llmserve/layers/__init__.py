"""The building blocks models are made of: linear layers with a pluggable weight method,
norms, rotary embeddings, activations, token embeddings, and paged attention over the KV
cache (`attention/`, `kv_cache.py`)."""
