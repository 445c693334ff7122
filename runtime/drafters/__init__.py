"""Who drafts a step's tokens: one interface (`Drafter`), one module per kind.

The generator drafts, verifies and commits without knowing which kind drafted: it asks the drafter for a
chain (`chain`) or a tree (`tree`), verifies with the target, and hands the outcome back (`settle_chain`,
`settle_tree`), which leaves the drafter's cache at the tokens each row kept.
  * `draft_model`: a separate draft model with its own KV cache (chains, trees, the n-gram second stage);
  * `ngram`: an n-gram model alone (trees; a chain is a one-child-per-level tree);
  * `head`: an EAGLE-3 or MTP head fed by the target's hidden states (chains);
  * `Drafter` itself: nothing drafts (k = 0 only).
"""
from .base import Drafter
from .draft_model import DraftModelDrafter
from .head import HeadDrafter
from .ngram import NGramDrafter


def drafter_for(draft, stage2=None, host_bookkeeping: bool = False, runner=None) -> Drafter:
    """The drafter for a generator's `draft`: a CausalLM, a DraftHead, an n-gram model, or None.
    `runner`: what runs a draft model's or a head's step passes (its CUDA graphs), when not the network itself."""
    from ..heads import DraftHead
    from ..model import CausalLM

    if isinstance(draft, CausalLM):
        return DraftModelDrafter(draft, stage2, host_bookkeeping, runner)
    if isinstance(draft, DraftHead):
        return HeadDrafter(draft, runner)
    if draft is not None:
        return NGramDrafter(draft)
    return Drafter()


__all__ = ["DraftModelDrafter", "Drafter", "HeadDrafter", "NGramDrafter", "drafter_for"]
