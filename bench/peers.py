"""transformers as a peer (--peers): the same pair loaded with Hugging Face, timed with `generate`.

Plain generation runs batched with left padding; assisted generation (the draft as
`assistant_model`) only at batch size 1, the only size transformers accepts. Both produce exactly
max_new_tokens per row, as ours do, and are timed with the same wall clock (`runtime.clock.DeviceClock`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specbatch.runtime.clock import DeviceClock
from specbatch.runtime.sampling import Sampling

from .config import BenchConfig, BenchModels
from .policies import HF_ASSISTED


@dataclass
class PeerModels:
    """Hugging Face copies of the pair, for --peers."""

    target: Any  # transformers PreTrainedModel
    draft: Any | None
    pad_token_id: int
    transformers_version: str


def load_peers(models: BenchModels, device: torch.device) -> tuple[PeerModels | None, str | None]:
    """The pair loaded with transformers, or (None, a one-line note saying why peers are skipped). A head as
    the draft is no model transformers can assist with: its plain generation runs, with a note."""
    from specbatch.perfmodel.table import drafter_phrase
    from specbatch.runtime.heads import DraftHead

    head = isinstance(models.draft, DraftHead)
    assistant = models.draft is not None and not head
    if models.target_dir is None or (assistant and models.draft_dir is None):
        return None, "--peers skipped: it needs model directories (shape presets have no Hugging Face weights)"
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None, "--peers skipped: transformers is not installed (pip install transformers)"
    # generate() warns about every flag it ignores and loading draws its own progress bar: either
    # would break the CLI's progress bar and output
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    dtype = models.target.lm_head.weight.dtype  # the same as ours: float32 on CPU unless told otherwise

    def load(directory: Path):
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
        return model.to(device).eval()

    target = load(models.target_dir)
    draft = load(models.draft_dir) if assistant else None
    config = target.config
    pad = config.pad_token_id if config.pad_token_id is not None else 0  # masked out: any id will do
    note = (f"--peers transformers: {HF_ASSISTED} skipped: its assistant_model is a draft model, and --draft is "
            f"{drafter_phrase(models.draft.kind)}" if head else None)
    return PeerModels(target=target, draft=draft, pad_token_id=int(pad),
                      transformers_version=transformers.__version__), note


def left_padded(prompts: list[list[int]], pad_token_id: int, device: torch.device):
    """(input_ids, attention_mask), both (b, longest prompt), padding on the left as generate() expects."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, prompt in enumerate(prompts):
        ids[r, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[r, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def _hf_sampling(sampling: Sampling) -> dict[str, Any]:
    """Our sampling settings in generate()'s words (explicit, so a checkpoint's defaults cannot differ)."""
    if sampling.greedy:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p}


@torch.inference_mode()
def time_peer(peers: PeerModels, name: str, prompts: list[list[int]], config: BenchConfig,
              seed: int, device: torch.device) -> dict[str, Any]:
    """One Hugging Face generate() call: plain (batched, left padding) or assisted (b = 1).

    min_new_tokens = max_new_tokens suppresses EOS, so every row produces exactly max_new_tokens, as ours do.
    """
    ids, mask = left_padded(prompts, peers.pad_token_id, device)
    options = dict(max_new_tokens=config.max_new_tokens, min_new_tokens=config.max_new_tokens,
                   pad_token_id=peers.pad_token_id, **_hf_sampling(config.sampling))
    if name == HF_ASSISTED:
        options["assistant_model"] = peers.draft
    torch.manual_seed(seed)
    clock = DeviceClock(device)
    start = clock.now()
    output = peers.target.generate(input_ids=ids, attention_mask=mask, **options)  # (b, width + new)
    seconds = clock.now() - start
    return dict(generated_tokens=int(output.shape[0] * (output.shape[1] - ids.shape[1])), seconds=seconds)
