"""What a mixture-of-experts model's passes read: its experts' shape (`models.<role>.experts`) and the routing
measured on it (the `routing` section), both optional; a dense model has neither.

A MoE pass reads the dense part of the weights plus, in each routed layer, only the experts its tokens route to.
How many distinct experts T tokens touch is a property of the router and the text, not of the kernels, so it is
measured apart from the pass times: calibrate runs the model over prompts, records every token's experts in every
routed layer, and counts the distinct experts in windows shaped like the passes it times (b rows from different
prompts, each n consecutive tokens). Random weights (a shape preset) route unlike trained ones: their rows are
recorded with `source` "random_weights", and a table computed from them says so.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import PerfModelError
from ..fields import ROLES, at, get, integer, listed, number, number_list, string

# where the routing rows came from: the model's own weights over text prompts, or random weights (a preset)
ROUTING_SOURCES = ("prompts", "random_weights")


@dataclass(frozen=True)
class ExpertShape:
    """The routed experts of one model (models.<role>.experts in a profile)."""

    num_experts: int  # experts per routed layer (N)
    experts_per_token: int  # the router's top-k (r)
    moe_layers: int  # layers whose MLP routes to experts
    expert_parameters: int  # one expert of one layer: its gate, up and down projections
    expert_bytes: int  # the same at the profiled dtype

    @property
    def routed_bytes(self) -> int:
        """Every expert of every routed layer: what a pass touching all of them reads."""
        return self.moe_layers * self.num_experts * self.expert_bytes

    @property
    def idle_parameters(self) -> int:
        """Parameters one token does not multiply: each routed layer's experts it is not routed to."""
        return self.moe_layers * (self.num_experts - self.experts_per_token) * self.expert_parameters

    def to_json(self) -> dict:
        return asdict(self)


def expert_shape_from_json(obj, where: str) -> ExpertShape:
    if not isinstance(obj, dict):
        raise PerfModelError(f"{where}: expected a JSON object, found {obj!r}")
    shape = ExpertShape(**{key: integer(obj, key, where, minimum=1) for key in
                           ("num_experts", "experts_per_token", "moe_layers", "expert_parameters", "expert_bytes")})
    if shape.experts_per_token > shape.num_experts:
        raise PerfModelError(f"{at(where, 'experts_per_token')}: {shape.experts_per_token} is more than the "
                             f"{shape.num_experts} experts a layer has")
    return shape


@dataclass(frozen=True)
class RoutingRow:
    """Distinct experts touched by b rows of n consecutive tokens, per routed layer (mean over `windows` draws)."""

    model: str  # target | draft
    batch_size: int
    new_tokens: int
    distinct_experts: tuple[float, ...]  # per routed layer, in layer order
    windows: int  # how many (b x n) windows were drawn

    @property
    def tokens(self) -> int:
        return self.batch_size * self.new_tokens

    @property
    def mean_distinct(self) -> float:
        """Mean over routed layers: what the bytes of a pass are linear in."""
        return sum(self.distinct_experts) / len(self.distinct_experts)

    def to_json(self) -> dict:
        return {"model": self.model, "batch_size": self.batch_size, "new_tokens": self.new_tokens,
                "distinct_experts": [round(value, 4) for value in self.distinct_experts], "windows": self.windows}


@dataclass(frozen=True)
class RoutingSection:
    source: str  # one of ROUTING_SOURCES
    prompts: str | None  # the prompt file (or "random tokens") the routing was measured over
    prompt_count: int
    rows: tuple[RoutingRow, ...]

    def rows_of(self, role: str) -> tuple[RoutingRow, ...]:
        return tuple(row for row in self.rows if row.model == role)

    def to_json(self) -> dict:
        return {"source": self.source, "prompts": self.prompts, "prompt_count": self.prompt_count,
                "rows": [row.to_json() for row in self.rows]}


def _routing_row(obj, where: str) -> RoutingRow:
    if not isinstance(obj, dict):
        raise PerfModelError(f"{where}: expected a JSON object, found {obj!r}")
    row = RoutingRow(model=string(obj, "model", where, ROLES), batch_size=integer(obj, "batch_size", where, 1),
                     new_tokens=integer(obj, "new_tokens", where, 1),
                     distinct_experts=number_list(obj, "distinct_experts", where),
                     windows=integer(obj, "windows", where, 1))
    if not row.distinct_experts or min(row.distinct_experts) < 1:
        raise PerfModelError(f"{at(where, 'distinct_experts')}: expected one count >= 1 per routed layer")
    return row


def routing_from_json(obj, where: str) -> RoutingSection:
    if not isinstance(obj, dict):
        raise PerfModelError(f"{where}: expected a JSON object, found {obj!r}")
    rows = tuple(_routing_row(item, f"{at(where, 'rows')}[{index}]")
                 for index, item in enumerate(listed(obj, "rows", where)))
    get(obj, "prompts", where)
    prompts = obj["prompts"]
    if prompts is not None and not isinstance(prompts, str):
        raise PerfModelError(f"{at(where, 'prompts')}: expected a string or null, found {prompts!r}")
    return RoutingSection(source=string(obj, "source", where, ROUTING_SOURCES), prompts=prompts,
                          prompt_count=int(number(obj, "prompt_count", where, minimum=0)), rows=rows)


def check_routing(routing: RoutingSection | None, experts_by_role: dict, where: str) -> None:
    """Rows only for roles with experts, one count per routed layer, none above the layer's experts, each
    (role, b, n) once."""
    if routing is None:
        return
    seen = set()
    for index, row in enumerate(routing.rows):
        spot = f"{where}: routing.rows[{index}]"
        experts = experts_by_role.get(row.model)
        if experts is None:
            raise PerfModelError(f"{spot}: the {row.model} has no experts (models.{row.model}.experts is absent)")
        if len(row.distinct_experts) != experts.moe_layers:
            raise PerfModelError(f"{spot}.distinct_experts: {len(row.distinct_experts)} counts for "
                                 f"{experts.moe_layers} routed layers")
        ceiling = min(experts.num_experts, row.tokens * experts.experts_per_token)
        if max(row.distinct_experts) > ceiling + 1e-6:
            raise PerfModelError(f"{spot}.distinct_experts: {max(row.distinct_experts):g} experts, but "
                                 f"{row.tokens} tokens of top-{experts.experts_per_token} routing among "
                                 f"{experts.num_experts} touch at most {ceiling}")
        key = (row.model, row.batch_size, row.new_tokens)
        if key in seen:
            raise PerfModelError(f"{spot}: duplicate row for {row.model} b={row.batch_size} n={row.new_tokens}")
        seen.add(key)
