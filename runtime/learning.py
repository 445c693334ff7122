"""The settings of the three online learners, in one record: the adaptive policy's acceptance estimator and
hysteresis (runtime.adaptive), the step-cost re-fit (runtime.refit) and the live fidelity check
(runtime.fidelity). docs/adaptive.md explains each; where a value was tuned, its comment says on what.

Memories are stated in the unit each learner counts: draft tokens of a request, or served steps. A weight
that fades by (1 - 1/m) per unit remembers about the last m units.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdaptiveSettings:
    prior_tokens: float = 4.0  # the calibrated prior rho = 1 is worth this many expected accepted tokens
    memory_tokens: float = 64.0  # a request's evidence fades by (1 - 1/64) per draft token
    switch_margin: float = 0.03  # relative predicted gain a challenger needs ...
    persist_steps: int = 2  # ... on this many consecutive steps at an unchanged batch size
    horizon_steps: int = 8  # steps a one-time catch-up cost is spread over
    context_bucket: int = 64  # context lengths are rounded up to this many tokens for the step-time cache
    guess_memory_steps: float = 8.0  # the second stage's guess rate fades by (1 - 1/8) per staged step
    guess_prior_steps: float = 2.0  # the calibrated guess rate is worth this many staged steps
    guess_levels: int = 11  # the guess rate is looked up on rank-0 accuracies 0, 0.1, ..., 1 (and the calibrated)
    cache_entries: int = 4096  # a per-(b, L) step-time cache past this size is emptied (long-running servers)


@dataclass(frozen=True)
class RefitSettings:
    role_prior_steps: float = 8.0  # the calibration's per-role factors 1 are worth this many served steps
    width_prior_steps: float = 64.0  # ... and its per-width factors this many
    memory_steps: float = 256.0  # evidence fades by (1 - 1/256) per step: the correction follows a drifting machine
    prior_floor: float = 1.0 / 16  # the priors' weights fade alike, down to this share of their start
    solve_every: int = 8  # steps between solves of the ridge system (a 19 x 19 solve)
    move_tolerance: float = 0.002  # factors are published anew only when one moved by more
    residual_prior: tuple[float, float] = (4.0, 0.05)  # the residual spread starts at 5 % of a step, worth 4 steps
    share_floor: float = 0.01  # a role's mean share of a step is taken as at least 1 %: no zero prior
    ratio_clip: float = 4.0  # a step measured beyond 4x (or under 1/4 of) its prediction counts as 4x: a stall


@dataclass(frozen=True)
class FidelitySettings:
    ratio_memory_steps: float = 32.0  # a cell's running ratio fades by (1 - 1/32) per step of the cell
    # a cell's first steps meet shapes the process has not run yet (allocations, kernel set-up) and set nothing;
    # the next settle_steps set its baseline ratio. Baselines from cold steps made a fresh server's warm steps
    # look like a x0.7 drift on the 2-core development CPU (benchmarks/serving_fidelity.py)
    warmup_steps: int = 16
    settle_steps: int = 32
    drift_memory_steps: float = 64.0  # the pooled deviation from the baselines fades by (1 - 1/64) per step
    # steps in a row out of the band (or back within half of it) before the state changes: a 1.5x change is
    # warned about ~80 steps after it at a 10 % band, ~150 at 34 %; at 32 a shared 2-core machine's slow spells
    # of ~0.5 s warned twice in 10 minutes at its own 34 % band (benchmarks/serving_fidelity.py)
    persist_steps: int = 64
    default_band: float = 0.10  # the relative band of a profile without a noise figure
    # the widest band (and model error) a check may allow: a profile noisier than this is announced as too noisy
    # to check closely, and a step model off by 2x is still seen (a ±160 % band let a x0.49 run pass silently)
    max_band: float = 0.25
    log_ratio_clip: float = math.log(4.0)  # a stalled step (swapped out, descheduled) counts as 4x, not as 40x


@dataclass(frozen=True)
class LearnerSettings:
    adaptive: AdaptiveSettings = field(default_factory=AdaptiveSettings)
    refit: RefitSettings = field(default_factory=RefitSettings)
    fidelity: FidelitySettings = field(default_factory=FidelitySettings)


LEARNING = LearnerSettings()
