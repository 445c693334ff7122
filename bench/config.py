"""What a bench run is given: its settings (`BenchConfig`, checked when built) and the pair under test.

Every setting the harness cannot measure meaningfully is refused here, before a model is loaded,
with a one-line `BenchError` naming the option.

`synthetic_acceptance` (for shape presets with random weights) accepts each draft token independently
with probability α instead of comparing with the target; every forward pass still runs. Results made
that way are labelled SYNTHETIC wherever they are written (`synthetic_label`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specbatch.perfmodel.errors import PerfModelError, SpecbatchError
from specbatch.perfmodel.tree import Tree, parse_tree
from specbatch.runtime.assembly import check_seed
from specbatch.runtime.model import CausalLM
from specbatch.runtime.sampling import Sampling

TREE_AUTO = "auto"  # --tree auto: the performance model's best tree at batch size 1
PEERS = ("transformers", "vllm")  # --peers: Hugging Face generate; vLLM's CPU build (bench/vllm/)


INTERLEAVE_MODES = ("steps", "runs")


class BenchError(SpecbatchError):
    """A bench configuration that cannot run; the message is one line naming the option."""


@dataclass(frozen=True)
class BenchConfig:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # the Su et al. grid
    ks: tuple[int, ...] = tuple(range(9))  # fixed k to compare; k = 0 (plain decoding) is always run
    max_new_tokens: int = 64  # per row; the same for every row so the batch stays full
    rounds: int = 5  # timed rounds per batch size: enough for a median and a p10-p90 band
    warmup_rounds: int = 1  # discarded rounds per batch size (first use of every shape)
    # at b <= RESOLVE_MAX_BATCH, at most this many extra rounds of the table and the best fixed k alone while
    # the table's paired regret is not settled (bench.regret); 0 turns them off
    resolve_rounds: int = 30
    sampling: Sampling = Sampling()
    synthetic_acceptance: float | None = None  # α in (0, 1]: benchmark-only fake verification
    seed: int = 0
    table_path: Path | None = None  # specbatch.table/1: adds the "table" policy
    model_path: Path | None = None  # specbatch.model/1: adds predicted tokens/s (and resolves --tree auto)
    # "transformers": also time Hugging Face generate (plain, and assisted at b = 1); "vllm": vLLM plain and
    # with our exported table, interleaved with ours (bench/vllm/compare.py)
    peers: tuple[str, ...] = ()
    trees: tuple[str, ...] = ()  # parse_tree specs ("0,1,0.0", "chain:8") or "auto": adds tree:SPEC policies
    stage2_path: Path | None = None  # specbatch.ngram/1 file (loaded into BenchModels.stage2): adds +ngram policies
    adaptive_path: Path | None = None  # specbatch.model/1: adds the "adaptive" policy (runtime.adaptive)
    adaptive_refit: bool = False  # the adaptive policy re-fits its step costs from the steps it runs (--refit)
    workload: str = "heldout"  # heldout | mixed | switch (bench.workload)
    second_prompts_path: Path | None = None  # mixed / switch: the other population (default data/prompts/base64.jsonl)
    # steps: a round's policies of ours advance in lockstep, a step of each in turn (bench.timing: why);
    # runs: one whole generation after another
    interleave: str = "steps"
    cuda_graphs: bool | None = None  # passes replay CUDA graphs: None, the device's default; False: --eager
    # run a --table, --model or --adaptive whose costs were measured in the other execution (perfmodel.execution)
    allow_mode_mismatch: bool = False

    def __post_init__(self):
        check_config(self)

    @property
    def fixed_ks(self) -> tuple[int, ...]:
        """The fixed k values run, ascending, k = 0 included."""
        return tuple(sorted(set(self.ks) | {0}))


def check_config(config: BenchConfig) -> None:
    """Refuse settings the harness cannot measure meaningfully; one-line messages naming the option."""
    if not config.batch_sizes:
        raise BenchError("--batch-sizes: give at least one batch size")
    if any(b <= 0 for b in config.batch_sizes):
        raise BenchError(f"--batch-sizes: every batch size must be positive, got {list(config.batch_sizes)}")
    if not config.ks:
        raise BenchError("--ks: give at least one k (e.g. 0,1,2,4)")
    if any(k < 0 for k in config.ks):
        raise BenchError(f"--ks: every k must be >= 0, got {list(config.ks)}")
    if config.max_new_tokens <= 0:
        raise BenchError(f"--max-new-tokens must be positive, got {config.max_new_tokens}")
    if config.rounds <= 0:
        raise BenchError(f"--rounds must be positive, got {config.rounds}")
    check_seed(config.seed)
    if config.adaptive_refit and config.adaptive_path is None:
        raise BenchError("--refit re-fits the adaptive policy's step costs: it needs --adaptive MODEL.json")
    if config.interleave not in INTERLEAVE_MODES:
        raise BenchError(f"--interleave {config.interleave!r}: expected one of {', '.join(INTERLEAVE_MODES)}")
    if config.resolve_rounds < 0:
        raise BenchError(f"--resolve-rounds must be >= 0, got {config.resolve_rounds}")
    if config.warmup_rounds < 0:
        raise BenchError(f"warm-up rounds must be >= 0, got {config.warmup_rounds}")
    alpha = config.synthetic_acceptance
    if alpha is not None and not 0.0 < alpha <= 1.0:
        raise BenchError(f"--synthetic-acceptance must be in (0, 1], got {alpha}")
    for peer in config.peers:
        if peer not in PEERS:
            raise BenchError(f"--peers: unknown peer {peer!r} (choose from {', '.join(PEERS)})")
    if alpha is not None and config.peers:
        raise BenchError("--peers cannot be combined with --synthetic-acceptance: the peers verify for real, "
                         "so the ratio would compare a fake acceptance with a real one")
    if "vllm" in config.peers and config.table_path is None:
        raise BenchError("--peers vllm needs --table FILE (a chains-only table: vLLM runs it from our export)")
    if "vllm" in config.peers and not config.sampling.greedy:
        raise BenchError("--peers vllm compares greedy outputs token for token: use --sampling greedy")
    for spec in config.trees:
        if spec.strip() != TREE_AUTO:
            tree_from_spec(spec)
    if alpha is not None and (config.trees or config.stage2_path is not None):
        option = "--tree" if config.trees else "--stage2"
        raise BenchError(f"{option} cannot be combined with --synthetic-acceptance: the runtime fakes acceptance "
                         "for plain chains only")
    from .workload import WORKLOADS

    if config.workload not in WORKLOADS:
        raise BenchError(f"--workload {config.workload!r}: expected one of {', '.join(WORKLOADS)}")
    if config.second_prompts_path is not None and config.workload == "heldout":
        raise BenchError("--second-prompts is read only with --workload mixed or switch")
    if any(spec.strip() == TREE_AUTO for spec in config.trees) and config.model_path is None:
        raise BenchError("--tree auto needs --model FILE (a specbatch.model/1 file from `specbatch fit`)")


def tree_from_spec(spec: str) -> Tree:
    """A --tree spec as `parse_tree` reads it; a bad one is a one-line BenchError naming the path."""
    try:
        return parse_tree(spec, "--tree")
    except PerfModelError as error:
        raise BenchError(str(error)) from None


def synthetic_label(alpha: float | None) -> str | None:
    """The label every output carries when acceptance was faked."""
    return None if alpha is None else f"SYNTHETIC acceptance α={alpha:g} (each draft token accepted with " \
                                      f"probability α; every forward pass ran)"


@dataclass
class BenchModels:
    """The pair under test, with where it came from (recorded in bench.json)."""

    target: CausalLM
    draft: CausalLM | None
    target_source: str  # directory, preset name or config.json path
    draft_source: str | None
    target_dir: Path | None = None  # Hugging Face directories: --peers loads them with transformers
    draft_dir: Path | None = None
    random_weights: bool = False  # shape presets / bare configs
    stage2: Any | None = None  # runtime.ngram.NGramModel for the +ngram policies (the CLI loads and checks it)
    # bench.memory.BenchMemory: the free memory measured before the pair was loaded, against which plan_bench
    # checks every batch size (None: not checked, as for a pair built in memory)
    memory: Any | None = None
