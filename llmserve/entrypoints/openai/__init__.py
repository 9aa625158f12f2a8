"""The OpenAI-compatible HTTP server (`llmserve serve`)."""
