"""Routing measured on a mixture-of-experts model: how many distinct experts a pass's tokens touch per layer.

The model runs over prompts (one prefill each, with its cache, as generation would feed them) and every routed
layer's router choices are recorded per token. A pass of b rows x n new tokens is then a window: b prompts (all
different while there are enough), n consecutive tokens of each at a random offset, and its distinct experts per
layer are counted; the mean over `WINDOWS` windows is the row for (b, n). Consecutive tokens of one prompt are
what a verify pass feeds (a row's k + 1 tokens are one continuation), and different prompts are what a batch's
rows are. The routes depend on the text, not on the kernels, so they are measured once, apart from the timings.

The timed passes of such a model are fed windows of the same prompts (`TextWindows`), so that the experts they
touch are those the routing rows count; random token ids would spread over more experts than text does.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import torch

from specbatch.perfmodel.profile import Grid, Profile
from specbatch.perfmodel.profile.routing import RoutingRow, RoutingSection
from specbatch.runtime.experts import RoutedExperts
from specbatch.runtime.model import CausalLM

WINDOWS = 64  # windows per (b, n): the mean's standard error is a few percent of it
MAX_ROUTING_PROMPTS = 128  # prompts recorded; the rows of a batch come from different ones up to this b
PREFILL_TOKENS = 512  # each prompt's last tokens at most: the windows need only a few


def routed_layers(model: CausalLM) -> list[RoutedExperts]:
    return [module for module in model.modules() if isinstance(module, RoutedExperts)]


@contextmanager
def recording_routes(model: CausalLM) -> Iterator[list[list[torch.Tensor]]]:
    """While open, every routed layer's chosen experts (tokens, top-k) are appended to its list, in layer order."""
    layers = routed_layers(model)
    records: list[list[torch.Tensor]] = [[] for _ in layers]

    def recorder(module: RoutedExperts, into: list[torch.Tensor]):
        original = module.route

        def route(x: torch.Tensor):
            experts, weights = original(x)
            into.append(experts.detach().to("cpu"))
            return experts, weights
        return route

    for module, into in zip(layers, records):
        module.route = recorder(module, into)
    try:
        yield records
    finally:
        for module in layers:
            del module.route  # the instance attribute goes: the class's method is back


@torch.inference_mode()
def record_routes(model: CausalLM, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Per prompt, (tokens, routed layers, top-k) expert ids, from one prefill of the prompt."""
    routes = []
    for prompt in prompts:
        ids = list(prompt)[-PREFILL_TOKENS:]
        tokens = torch.tensor([ids], device=model.lm_head.weight.device)
        cache = model.new_cache(1, len(ids))
        cache.set_lengths(None, [0])
        with recording_routes(model) as records:
            model(tokens, cache, last=0)
        routes.append(np.stack([torch.cat(layer).numpy() for layer in records], axis=1))
    return routes


def distinct_per_layer(routes: Sequence[np.ndarray], num_experts: int, batch_size: int, new_tokens: int,
                       rng: np.random.Generator, windows: int = WINDOWS) -> np.ndarray | None:
    """Mean distinct experts per routed layer over `windows` windows of b rows x n consecutive tokens; None when
    no prompt is n tokens long. Rows come from different prompts while there are enough of them."""
    usable = [r for r in routes if len(r) >= new_tokens]
    if not usable:
        return None
    layers = usable[0].shape[1]
    total = np.zeros(layers)
    for _ in range(windows):
        picks = rng.choice(len(usable), size=batch_size, replace=batch_size > len(usable))
        touched = np.zeros((layers, num_experts), dtype=bool)
        for pick in picks:
            route = usable[pick]
            start = rng.integers(0, len(route) - new_tokens + 1)
            window = route[start:start + new_tokens]  # (n, layers, k)
            for layer in range(layers):
                touched[layer, window[:, layer, :].ravel()] = True
        total += touched.sum(axis=1)
    return total / windows


def routing_section(routes_by_role: dict[str, list[np.ndarray]], experts_by_role: dict[str, int], grid: Grid,
                    source: str, prompts: str | None, seed: int = 0) -> RoutingSection:
    """The profile's routing rows: for each role with experts, every (b, n) of the grid its passes take."""
    rng = np.random.default_rng(seed)
    rows = []
    for role, routes in routes_by_role.items():
        widths = grid.target_new_tokens if role == "target" else grid.draft_new_tokens
        for b in grid.batch_sizes:
            for n in widths:
                counts = distinct_per_layer(routes, experts_by_role[role], b, n, rng)
                if counts is not None:
                    rows.append(RoutingRow(role, b, n, tuple(float(c) for c in counts), WINDOWS))
    return RoutingSection(source=source, prompts=prompts,
                          prompt_count=max((len(routes) for routes in routes_by_role.values()), default=0),
                          rows=tuple(rows))


def expert_roles(profile: Profile) -> tuple[str, ...]:
    """The roles whose model is a mixture of experts and whose routing is measured over prompts. A head's layer
    (GLM-4.5's MTP layer) routes too, but it reads the target's hidden states, which a prefill of its own cannot
    give: its expert term keeps the uniform prior, and the table says so."""
    return tuple(role for role in ("target", "draft")
                 if profile.model(role).experts is not None and not profile.model(role).is_head)


def measure_routing(models: dict[str, CausalLM], prompts: Sequence[Sequence[int]], grid: Grid, random_weights: bool,
                    prompts_source: str | None) -> RoutingSection:
    """The profile's routing section for `models` (role -> a mixture of experts) over `prompts`: the prompt file's
    text, or random token ids for random weights, which the section says."""
    return routing_section({role: record_routes(model, prompts) for role, model in models.items()},
                           {role: model.config.num_experts for role, model in models.items()}, grid,
                           "random_weights" if random_weights else "prompts",
                           "random tokens" if random_weights else prompts_source)


class TextWindows:
    """Token ids for a timed pass of a mixture of experts: b rows of n consecutive tokens from different prompts,
    the same for the same (b, n, seed), so a point's samples all route alike."""

    def __init__(self, prompts: Sequence[Sequence[int]]):
        self.prompts = [list(p) for p in prompts if p]

    def __call__(self, batch_size: int, new_tokens: int, seed: int) -> torch.Tensor | None:
        usable = [p for p in self.prompts if len(p) >= new_tokens]
        if not usable:
            return None
        rng = np.random.default_rng(seed)
        picks = rng.choice(len(usable), size=batch_size, replace=batch_size > len(usable))
        rows = []
        for pick in picks:
            start = int(rng.integers(0, len(usable[pick]) - new_tokens + 1))
            rows.append(usable[pick][start:start + new_tokens])
        return torch.tensor(rows)  # (b, n)
