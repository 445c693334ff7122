"""KV caches kept between generations, one per (model, owner): a finished generation's caches serve the next.

Why keep them: memory new to the process costs a page fault per page touched (about 15,000 a generation of
the demo pair at b = 32 with 64 new tokens, 2-3 % of its time on a CPU), and on CUDA a cache carries the
graphs captured on it (runtime.cuda_graphs): a fresh cache would capture again. Why per owner: bench and
calibrate run several generations side by side in lockstep (calibrate.lockstep), one per policy, in a
rotating order; each policy (the owner: the policy object, or its value when it is hashable) gets back the
cache it had, with the graphs its widths need, so a timed round after a warm-up never captures.

Memory stays bounded: a new cache is made only when the owner's kept one is missing or too small, and the
caches kept for another number of rows are freed first (a bench moving to the next batch size). With
`granularity` (graphs on) the slots per row are rounded up, so that batches of slightly longer prompts in a
later round still fit the kept cache.
"""
from __future__ import annotations

from typing import Callable, Hashable

from .kv_cache import KVCache

MAX_KEPT = 16  # caches kept per model at most: a lockstep of more contenders than this makes fresh ones


def owner_key(policy) -> Hashable:
    """Whose cache it is: the policy itself when it is hashable (FixedK(4) made twice is one owner), else its
    identity (a table, an adaptive policy: the same object round after round)."""
    try:
        hash(policy)
        return policy
    except TypeError:
        return ("object", id(policy))


class CachePool:
    def __init__(self, new_cache: Callable[[str, int, int], KVCache], granularity: int = 1):
        """`new_cache(role, rows, max_len)` makes a cache; `granularity`: slots per row are a multiple of it."""
        self.new_cache, self.granularity = new_cache, granularity
        self.kept: dict[tuple[str, Hashable], KVCache] = {}  # (role, owner) -> a root cache, oldest first
        self.made = 0  # caches made so far (tests: a warmed-up round makes none)

    def take(self, role: str, rows: int, max_len: int, owner: Hashable = None) -> KVCache:
        """A cache of `rows` rows with at least `max_len` slots each: the owner's kept one (its first `rows`
        rows) when it is large enough, else a new one."""
        kept = self.kept.pop((role, owner), None)
        if kept is not None and kept.batch_size >= rows and kept.max_len >= max_len:
            return kept.rows(0, rows)
        del kept
        for key in [key for key, cache in self.kept.items() if key[0] == role and cache.batch_size != rows]:
            del self.kept[key]  # another batch size's: freed before allocating
        self.made += 1
        return self.new_cache(role, rows, -(-max_len // self.granularity) * self.granularity)

    def keep(self, role: str, cache: KVCache | None, owner: Hashable = None) -> None:
        """Keep a finished generation's cache for the owner's next (the larger, if it has one kept)."""
        if cache is None:
            return
        kept = self.kept.get((role, owner))
        if kept is None or cache.root.keys.numel() > kept.keys.numel():
            self.kept.pop((role, owner), None)
            self.kept[(role, owner)] = cache.root
        mine = [key for key in self.kept if key[0] == role]
        for key in mine[:max(0, len(mine) - MAX_KEPT)]:
            del self.kept[key]

    def clear(self) -> None:
        self.kept.clear()

    def __len__(self) -> int:
        return len(self.kept)
