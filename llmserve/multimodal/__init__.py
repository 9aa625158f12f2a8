"""Images into a vision-language model's inputs: `images.py` (decoding untrusted bytes,
`ImageInput`), `processors.py` (each checkpoint family's preprocessing)."""
