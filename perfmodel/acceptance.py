"""Acceptance: how many tokens a speculative step yields on average.

`alpha_i` is the probability that draft token i is accepted given that tokens 1..i-1 were. A step
with k draft tokens always yields the target's own token, plus draft token i if all of 1..i were
accepted, so

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} alpha_j          (E(0) = 1)

and with a constant alpha, E(k) = (1 - alpha^(k+1)) / (1 - alpha).

Assumption: acceptance does not depend on the batch size or on the context length, and positions
are independent of the step's history beyond "all earlier tokens accepted".

Positions beyond the measured (or given) list reuse the LAST value: it is the nearest measurement
of the conditional probability at late positions, which the constant-alpha fit (a whole-list
average) would blur. The constant fit is reported for goodness of fit, not used for extension.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import PerfModelError
from .fields import at, int_list, is_int, listed, number, number_list, string
from .jsonio import rounded
from .profile import AcceptanceEntry


def extend_alphas(alphas: Sequence[float], k: int) -> tuple[float, ...]:
    """The first k acceptance probabilities, repeating the last given value past the end."""
    if k <= 0:
        return ()
    if not alphas:
        raise PerfModelError("acceptance: no per-position values to extend")
    values = tuple(float(alpha) for alpha in alphas)
    return values[:k] + (values[-1],) * max(0, k - len(values))


def accept_all_probability(alphas: Sequence[float], k: int) -> float:
    """P(a row accepts all k draft tokens) = prod_{i<=k} alpha_i (1 for k = 0)."""
    return float(np.prod(extend_alphas(alphas, k))) if k > 0 else 1.0


def expected_tokens(alphas: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{i=1..k} prod_{j<=i} alpha_j: tokens a row gains per step with k draft tokens.

    >>> expected_tokens([0.5], 2)  # 1 + 0.5 + 0.25
    1.75
    """
    if k < 0:
        raise PerfModelError(f"k must be >= 0, found {k}")
    survival = np.cumprod(extend_alphas(alphas, k))  # P(tokens 1..i all accepted), i = 1..k
    return 1.0 + float(survival.sum())


def tokens_variance(alphas: Sequence[float], k: int) -> float:
    """Var(tokens a row gains in a chain step of k), from the same survival s_i = prod_{j<=i} alpha_j as
    E(k): with A the accepted count, E[A] = sum_i s_i and E[A^2] = sum_i (2i - 1) s_i.

    >>> round(tokens_variance([0.8], 2), 4)  # T = 1, 2, 3 with 0.2, 0.16, 0.64
    0.6464
    """
    if k <= 0:
        return 0.0
    survival = np.cumprod(extend_alphas(alphas, k))
    return float(((2 * np.arange(1, k + 1) - 1) * survival).sum() - survival.sum() ** 2)


@dataclass(frozen=True)
class ConstantAlphaFit:
    """The single alpha whose powers best match the measured cumulative products (least squares)."""

    alpha: float
    rmse: float  # of alpha^i against prod_{j<=i} alpha_j, over the measured positions
    r_squared: float | None  # None when the cumulative products have no variance (one position)


def fit_constant_alpha(per_position: Sequence[float]) -> ConstantAlphaFit:
    """Fit alpha^i to the cumulative products prod_{j<=i} alpha_j, i = 1..len(per_position).

    Fitting the products rather than the alphas weights early positions more, as E(k) does: a miss
    at position 1 costs every later token.
    """
    from scipy.optimize import minimize_scalar

    survival = np.cumprod(np.asarray(per_position, dtype=float))
    positions = np.arange(1, len(survival) + 1)

    def squared_error(alpha: float) -> float:
        return float(np.sum((alpha ** positions - survival) ** 2))

    alpha = float(minimize_scalar(squared_error, bounds=(0.0, 1.0), method="bounded",
                                  options={"xatol": 1e-10}).x)
    residual = squared_error(alpha)
    spread = float(np.sum((survival - survival.mean()) ** 2))
    return ConstantAlphaFit(
        alpha=alpha,
        rmse=float(np.sqrt(residual / len(survival))),
        r_squared=1.0 - residual / spread if spread > 1e-12 else None,
    )


def check_alphas(values: Sequence[float], option: str) -> tuple[float, ...]:
    """Acceptance values given by a user must lie in (0, 1]; `option` names where they came from."""
    if not values:
        raise PerfModelError(f"{option}: needs at least one acceptance value")
    for value in values:
        if not 0.0 < value <= 1.0:
            raise PerfModelError(f"{option}: acceptance {value:g} is outside (0, 1]")
    return tuple(float(value) for value in values)


def parse_acceptance_option(text: str, option: str = "--acceptance") -> tuple[float, ...]:
    """'0.8' (one alpha for every position) or '0.9,0.85,0.8' (per position) -> validated tuple."""
    values = []
    for part in text.split(","):
        try:
            values.append(float(part))
        except ValueError:
            raise PerfModelError(f"{option}: {part.strip()!r} is not a number "
                                 "(expected e.g. 0.8 or 0.9,0.85,0.8)") from None
    return check_alphas(values, option)


@dataclass(frozen=True)
class AcceptanceModel:
    """The acceptance used for goodput: per-position alphas plus the constant fit that summarizes them."""

    source: str  # "profile" (measured by calibrate) or "user" (--acceptance what-if)
    mode: str | None  # greedy | sampling | None for a user what-if
    temperature: float | None
    per_position: tuple[float, ...]
    constant: ConstantAlphaFit
    # measured E(k), k = 0..max_k, under the runtime's step dynamics; preferred over the product
    # formula, which assumes a step may start anywhere (it over-counts: steps start right after a
    # disagreement, where the next token is harder)
    tokens_per_step: tuple[float, ...] | None = None
    # per depth d and rank r, P(the target's token at depth d is the draft's rank-r child | path to d-1
    # accepted): what a tree's expected tokens need (perfmodel.tree.expected_tree_tokens); None: chains only
    rank_acceptance: tuple[tuple[float, ...], ...] | None = None
    # greedy: recorded ranks per continuation, on which tree steps are replayed exactly (preferred for E)
    rank_sequences: tuple[tuple[int, ...], ...] | None = None
    # the sample behind the estimates (perfmodel.uncertainty): times each position was reached, and the
    # standard error of each measured E(k) across prompts; None when not measured (user values, old files)
    trials: tuple[int, ...] | None = None
    tokens_per_step_se: tuple[float, ...] | None = None
    step_counts_by_prompt: tuple[tuple[tuple[float, float], ...], ...] | None = None  # k = 1..max_k: [tokens, steps]

    def alphas(self, k: int) -> tuple[float, ...]:
        return extend_alphas(self.per_position, k)

    def expected_tokens(self, k: int) -> float:
        if self.tokens_per_step is not None and k < len(self.tokens_per_step):
            return self.tokens_per_step[k]
        return expected_tokens(self.per_position, k)

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "mode": self.mode,
            "temperature": self.temperature,
            "per_position": [rounded(alpha) for alpha in self.per_position],
            "extension": "last value repeated",
            "constant_alpha": rounded(self.constant.alpha),
            "constant_alpha_rmse": rounded(self.constant.rmse),
            "constant_alpha_r_squared": rounded(self.constant.r_squared),
            "tokens_per_step": None if self.tokens_per_step is None else [rounded(t) for t in self.tokens_per_step],
            "rank_acceptance": None if self.rank_acceptance is None
            else [[rounded(p) for p in row] for row in self.rank_acceptance],
            "rank_sequences": None if self.rank_sequences is None else [list(row) for row in self.rank_sequences],
            "trials": None if self.trials is None else list(self.trials),
            "tokens_per_step_se": None if self.tokens_per_step_se is None
            else [rounded(se) for se in self.tokens_per_step_se],
            "step_counts_by_prompt": None if self.step_counts_by_prompt is None
            else [[[rounded(t), rounded(n)] for t, n in per_k] for per_k in self.step_counts_by_prompt],
        }

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "AcceptanceModel":
        at_entry = where  # the entry itself ("model.json: acceptance[0]"): each field named by the profile's rules

        def rows(key: str, read) -> tuple | None:
            values = listed(obj, key, at_entry, nullable=True) if key in obj else None
            if values is None:
                return None
            return tuple(read({f"{key}[{index}]": row}, f"{key}[{index}]", at_entry)
                         for index, row in enumerate(values))

        per_position = number_list(obj, "per_position", at_entry)
        model = cls(source=string(obj, "source", at_entry), mode=string(obj, "mode", at_entry, nullable=True),
                    temperature=number(obj, "temperature", at_entry, nullable=True), per_position=per_position,
                    constant=ConstantAlphaFit(number(obj, "constant_alpha", at_entry),
                                              number(obj, "constant_alpha_rmse", at_entry),
                                              number(obj, "constant_alpha_r_squared", at_entry, nullable=True)),
                    tokens_per_step=number_list(obj, "tokens_per_step", at_entry, nullable=True)
                    if "tokens_per_step" in obj else None,
                    rank_acceptance=rows("rank_acceptance", number_list),
                    rank_sequences=rows("rank_sequences", lambda o, k, w: int_list(o, k, w, 0)),
                    trials=int_list(obj, "trials", at_entry, 0, nullable=True) if "trials" in obj else None,
                    tokens_per_step_se=number_list(obj, "tokens_per_step_se", at_entry, nullable=True)
                    if "tokens_per_step_se" in obj else None,
                    step_counts_by_prompt=_step_counts(obj, at_entry))
        if not per_position or not all(0.0 <= alpha <= 1.0 for alpha in per_position):
            raise PerfModelError(f"{at(where, 'per_position')}: expected probabilities in [0, 1]")
        rank = model.rank_acceptance
        if rank is not None and (not rank or not rank[0] or any(len(row) != len(rank[0]) for row in rank)
                                 or not all(0.0 <= p <= 1.0 for row in rank for p in row)):
            raise PerfModelError(f"{at(where, 'rank_acceptance')}: expected equal-length rows of probabilities")
        return model


def _step_counts(obj: dict, where: str) -> tuple | None:
    """step_counts_by_prompt: per k, a [tokens, steps] pair per prompt."""
    per_k = listed(obj, "step_counts_by_prompt", where, nullable=True) if "step_counts_by_prompt" in obj else None
    if per_k is None:
        return None
    counts = []
    for k, pairs in enumerate(per_k):
        at_k = f"{at(where, 'step_counts_by_prompt')}[{k}]"
        rows = listed({"pairs": pairs}, "pairs", at_k)
        for index, pair in enumerate(rows):
            if not (isinstance(pair, list) and len(pair) == 2 and all(is_int(v) or isinstance(v, float) for v in pair)):
                raise PerfModelError(f"{at_k}[{index}]: expected [tokens, steps], found {pair!r}")
        counts.append(tuple((float(t), float(n)) for t, n in rows))
    return tuple(counts)


def acceptance_from_profile(entry: AcceptanceEntry) -> AcceptanceModel:
    return AcceptanceModel(source="profile", mode=entry.mode, temperature=entry.temperature,
                           per_position=entry.per_position, constant=fit_constant_alpha(entry.per_position),
                           tokens_per_step=entry.tokens_per_step, rank_acceptance=entry.rank_acceptance,
                           rank_sequences=entry.rank_sequences, trials=entry.trials,
                           tokens_per_step_se=entry.tokens_per_step_se,
                           step_counts_by_prompt=entry.step_counts_by_prompt)


def acceptance_from_user(values: Sequence[float], option: str = "--acceptance") -> AcceptanceModel:
    alphas = check_alphas(values, option)
    return AcceptanceModel(source="user", mode=None, temperature=None, per_position=alphas,
                           constant=fit_constant_alpha(alphas))
