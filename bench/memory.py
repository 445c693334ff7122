"""What a bench run holds in memory at each batch size, checked before anything is measured with calibration's
own accounting (calibrate.memory: caches, token buffers, the largest pass, CUDA graphs), against the memory that
was free before the pair was loaded: a batch size that cannot fit is refused in one line naming --batch-sizes,
not found out by the allocator in the middle of a run.

With --interleave steps a round's policies of ours generate in lockstep (bench.timing), so all their generations
are alive together, exactly like a lockstep group of calibration's in-situ stage; with --interleave runs one
generation is alive at a time. A tree of N nodes is counted as a chain of N draft tokens (the same buffer margin
and verify width). The peers (transformers, vLLM) allocate on their own and are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specbatch.calibrate.memory import MemoryBudget, lockstep_bytes
from specbatch.perfmodel.profile import ModelInfo

from .config import BenchError


@dataclass(frozen=True)
class BenchMemory:
    """The budget measured before loading the pair, the two models as calibration describes them, and whether
    the attention kernel materializes its scores (calibrate.environment.attention_kernel)."""

    budget: MemoryBudget
    target: ModelInfo
    draft: ModelInfo
    scores_materialized: bool


def bench_memory(target_spec, draft_spec, device: str, dtype) -> BenchMemory:
    """Measure the free memory now (call it before loading the pair) and describe the pair at `dtype`;
    weights that leave no room are refused here, as calibrate refuses them."""
    from specbatch.calibrate.environment import attention_kernel, available_memory_bytes
    from specbatch.calibrate.memory import memory_budget
    from specbatch.calibrate.models import model_info

    target, draft = model_info(target_spec, dtype), model_info(draft_spec, dtype)
    budget = memory_budget(target, draft, available_memory_bytes(device), device)
    math_attention = any(attention_kernel(device, dtype, info.heads, info.kv_heads, info.head_dim) == "MATH"
                         for info in (target, draft))
    return BenchMemory(budget, target, draft, math_attention)


def round_bytes(memory: BenchMemory, batch_size: int, ks: Sequence[int], longest_prompt: int, new_tokens: int,
                together: bool, graphs: bool) -> int:
    """What one round at `batch_size` holds beside the weights: the generations of `ks` (each policy's most
    draft tokens a step) alive together (`together`, lockstep) or the largest of them alone."""
    def held(group: list[int]) -> int:
        return lockstep_bytes(memory.target, memory.draft, batch_size, group, longest_prompt, new_tokens,
                              memory.scores_materialized, graphs)

    return held(list(ks)) if together else max(held([k]) for k in ks)


def largest_fitting_batch(memory: BenchMemory, ks: Sequence[int], longest_prompt: int, new_tokens: int,
                          together: bool, graphs: bool, below: int) -> int:
    """The largest batch size under `below` whose round fits (0 when not even one row does): the bytes grow
    with the batch size, so a bisection finds it."""
    low, high = 0, below  # fits(low) holds (0 rows: nothing), fits(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        fits = memory.budget.fits(round_bytes(memory, middle, ks, longest_prompt, new_tokens, together, graphs))
        low, high = (middle, high) if fits else (low, middle)
    return low


def check_bench_memory(memory: BenchMemory, batch_sizes: Sequence[int], ks: Sequence[int], longest_prompt: int,
                       new_tokens: int, together: bool, graphs: bool) -> None:
    """Refuse, in one line naming --batch-sizes, the batch sizes whose rounds cannot fit, with the largest that
    does."""
    too_large = [b for b in sorted(set(batch_sizes))
                 if not memory.budget.fits(round_bytes(memory, b, ks, longest_prompt, new_tokens, together, graphs))]
    if not too_large:
        return
    smallest = too_large[0]
    need = round_bytes(memory, smallest, ks, longest_prompt, new_tokens, together, graphs)
    largest = largest_fitting_batch(memory, ks, longest_prompt, new_tokens, together, graphs, smallest)
    held = (f"the {len(ks)} policies' generations in lockstep (--interleave steps) need" if together and len(ks) > 1
            else "a generation needs")
    advice = (f"at most {largest} fits" if largest else "not even batch size 1 fits")
    if together and len(ks) > 1:
        advice += "; --interleave runs holds one generation at a time, fewer --ks hold less"
    raise BenchError(f"--batch-sizes {','.join(map(str, too_large))}: at b={smallest} {held} "
                     f"{memory.budget.reason(need)}; {advice}")

