"""A second tier for the prefix cache's KV blocks: local disk or host memory."""

from llmserve.kv_tier.layout import TierLayout, code_fingerprint, fingerprint_files, model_files
from llmserve.kv_tier.store import BlockStore, DiskBlockStore, HostBlockStore, TierStats

__all__ = ["BlockStore", "DiskBlockStore", "HostBlockStore", "TierLayout", "TierStats",
           "code_fingerprint", "fingerprint_files", "model_files"]
