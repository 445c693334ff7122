"""How many experts a mixture-of-experts pass reads: the expert term of the latency model.

With N experts per layer and top-r routing, T tokens routed independently and uniformly touch

    D_uniform(T) = N (1 - (1 - r/N)^T)

distinct experts a layer (each expert is missed by one token with probability 1 - r/N). Trained routers touch
fewer: the tokens of one text share experts. The fitted form keeps the uniform formula's shape and counts
tokens as fewer independent draws,

    D(b, n) = N (1 - (1 - r/N)^(b^row_exponent * n^token_exponent)),

for a pass of b rows each feeding n consecutive tokens: `token_exponent` < 1 says consecutive tokens of one row
share experts (a verify pass's k + 1 tokens are one continuation), `row_exponent` < 1 that rows of different
texts do too. Both exponents are 1 under the uniform prior; D(1, 1) = r exactly; D grows with b and n and stays
below N. They are fitted to the profile's routing rows by least squares on log D, with the uniform prior as a
weak penalty (`PRIOR_WEIGHT`) that decides only what the rows leave open; a profile without routing rows has the
prior itself, and rows from random weights are no trained router's routing (`RoutingFit.source` says which).

The bytes of a pass are then the dense part plus each routed layer's touched experts,

    bytes(b, n) = weight_bytes - moe_layers * N * expert_bytes + moe_layers * expert_bytes * D(b, n),

and its FLOPs count the active parameters (every token multiplies r experts a layer): perfmodel.latency.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import PerfModelError
from .fields import at, integer, number, string
from .jsonio import rounded
from .profile.routing import ExpertShape, RoutingRow

UNIFORM, MEASURED, RANDOM_WEIGHTS = "uniform prior", "measured", "random weights"
FIT_SOURCES = (UNIFORM, MEASURED, RANDOM_WEIGHTS)
# the prior: a penalty of log(exponent)^2 at a hundredth of one routing row's squared log error. It decides only
# what the rows leave open (two exponents that trade off over a narrow range of b and n); an exponent the rows
# cannot inform at all (every row has n = 1, or b = 1) is held at 1
PRIOR_WEIGHT = 0.01
MIN_EXPONENT = 0.05  # T_eff = T^0.05: 32 tokens count as 1.2 draws; below it routing is as good as constant


def uniform_distinct_experts(num_experts: int, experts_per_token: int, tokens) -> np.ndarray:
    """Expected distinct experts T tokens touch in one layer under independent uniform top-r routing."""
    missed = 1.0 - experts_per_token / num_experts
    return num_experts * (1.0 - missed ** np.asarray(tokens, dtype=float))


@dataclass(frozen=True)
class RoutingFit:
    """D(b, n), the distinct experts per routed layer for b rows of n consecutive tokens (module docstring)."""

    row_exponent: float = 1.0
    token_exponent: float = 1.0
    source: str = UNIFORM  # one of FIT_SOURCES
    rows: int = 0  # routing rows fitted
    mape_pct: float | None = None  # in-sample error of D on those rows
    cv_mape_pct: float | None = None  # leave-one-batch-size-out error: how well D interpolates b

    def effective_tokens(self, b, n):
        b, n = np.asarray(b, dtype=float), np.asarray(n, dtype=float)
        return b ** self.row_exponent * n ** self.token_exponent

    def distinct(self, shape: ExpertShape, b, n):
        """Expected distinct experts per routed layer (arrays broadcast)."""
        return uniform_distinct_experts(shape.num_experts, shape.experts_per_token, self.effective_tokens(b, n))

    @property
    def is_models(self) -> bool:
        """Whether the routing is a trained model's (measured on its weights over text)."""
        return self.source == MEASURED

    def describe(self) -> str:
        if self.source == UNIFORM:
            return "uniform routing (no routing measured): the prior, not this model's router"
        what = "measured on the model over prompts" if self.is_models else \
            "measured on random weights, which route unlike a trained model"
        return (f"{what}: b^{self.row_exponent:.3g} x n^{self.token_exponent:.3g} independent draws"
                + ("" if self.mape_pct is None else f", fit error {self.mape_pct:.1f} %"))

    def to_json(self) -> dict:
        return {"row_exponent": rounded(self.row_exponent), "token_exponent": rounded(self.token_exponent),
                "source": self.source, "rows": self.rows,
                "mape_pct": None if self.mape_pct is None else rounded(self.mape_pct),
                "cv_mape_pct": None if self.cv_mape_pct is None else rounded(self.cv_mape_pct)}


def routing_fit_from_json(obj, where: str) -> RoutingFit:
    if not isinstance(obj, dict):
        raise PerfModelError(f"{where}: expected a JSON object, found {obj!r}")
    exponents = {key: number(obj, key, where, minimum=MIN_EXPONENT) for key in ("row_exponent", "token_exponent")}
    for key, value in exponents.items():
        if value > 1.0:
            raise PerfModelError(f"{at(where, key)}: {value:g} > 1 would count more independent draws than tokens")
    return RoutingFit(**exponents, source=string(obj, "source", where, FIT_SOURCES),
                      rows=integer(obj, "rows", where, 0), mape_pct=number(obj, "mape_pct", where, nullable=True),
                      cv_mape_pct=number(obj, "cv_mape_pct", where, nullable=True))


def _solve(shape: ExpertShape, b: np.ndarray, n: np.ndarray, measured: np.ndarray) -> tuple[float, float]:
    from scipy.optimize import least_squares

    log_measured = np.log(measured)
    # an exponent the rows cannot inform (every row has n = 1, or b = 1) is held by the prior alone
    free = np.array([len(np.unique(b)) > 1, len(np.unique(n)) > 1])
    prior = np.sqrt(PRIOR_WEIGHT)

    def residuals(log_exponents: np.ndarray) -> np.ndarray:
        row_exponent, token_exponent = np.exp(log_exponents)
        tokens = b ** row_exponent * n ** token_exponent
        model = uniform_distinct_experts(shape.num_experts, shape.experts_per_token, tokens)
        return np.concatenate([np.log(model) - log_measured, prior * log_exponents * free,
                               1e3 * log_exponents * ~free])

    fit = least_squares(residuals, np.full(2, -1e-3), bounds=(np.log([MIN_EXPONENT] * 2), [0.0, 0.0]))
    return float(np.exp(fit.x[0])), float(np.exp(fit.x[1]))


def fit_routing(shape: ExpertShape, rows: Sequence[RoutingRow], random_weights: bool) -> RoutingFit:
    """The exponents fitted to one role's routing rows; the uniform prior when there are none."""
    if not rows:
        return RoutingFit()
    b = np.array([row.batch_size for row in rows], dtype=float)
    n = np.array([row.new_tokens for row in rows], dtype=float)
    measured = np.array([row.mean_distinct for row in rows])
    row_exponent, token_exponent = _solve(shape, b, n, measured)
    fitted = RoutingFit(row_exponent, token_exponent)
    in_sample = _mape(fitted.distinct(shape, b, n), measured)
    cv = None
    if len(np.unique(b)) >= 3:  # leave each batch size out: the table asks for b between measured ones
        predicted = np.empty_like(measured)
        for value in np.unique(b):
            held = b == value
            part = RoutingFit(*_solve(shape, b[~held], n[~held], measured[~held]))
            predicted[held] = part.distinct(shape, b[held], n[held])
        cv = _mape(predicted, measured)
    return RoutingFit(row_exponent, token_exponent, RANDOM_WEIGHTS if random_weights else MEASURED, len(rows),
                      in_sample, cv)


def _mape(predicted: np.ndarray, measured: np.ndarray) -> float:
    return float(np.mean(np.abs(predicted - measured) / measured) * 100.0)


def table_term(shape: ExpertShape, routing: RoutingFit) -> dict:
    """What a table records of a role's expert term: the experts' layout and the fitted routing."""
    return {"num_experts": shape.num_experts, "experts_per_token": shape.experts_per_token,
            "moe_layers": shape.moe_layers, "routing": routing.to_json()}


def routing_note(role: str, routing: RoutingFit) -> str | None:
    """The note a table carries when its expert term rests on routing that is not the model's own."""
    if routing.is_models:
        return None
    return (f"{role}: the expert term assumes {routing.describe()}: real routers touch fewer experts (tokens of one "
            "text share them), so speculation is cheaper at small b than this table says; calibrate the model's "
            "own weights to measure its routing")
