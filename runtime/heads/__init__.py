"""Draft heads: small networks that draft from the target's own hidden states (EAGLE-3, MTP).

`config` reads a head's `config.json` (the `speculators` format vLLM reads, or EAGLE-3's original layout) and
checks it against its target before anything is loaded; `model` is the head itself (one decoder layer over the
target's features, its own one-layer KV cache); `loading` fills it from its safetensors or with random weights
of a preset's shapes. The drafting itself is runtime.drafters.head.
"""
from .config import HEAD_KINDS, HeadConfig, HeadError, is_head_dir, read_head_config
from .loading import load_head, random_head, save_head
from .model import DraftHead, HeadCache, HeadPasses

__all__ = ["HEAD_KINDS", "DraftHead", "HeadCache", "HeadConfig", "HeadError", "HeadPasses", "is_head_dir", "load_head",
           "random_head", "read_head_config", "save_head"]
