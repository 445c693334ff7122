"""What a bench run measures, decided before anything is timed: the contenders at every batch size,
their prompts, the order of each round, and every check that can refuse the run (a missing draft or
n-gram model, a bad table or model file, --tree auto's resolution, the models' context).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from specbatch.perfmodel.execution import EAGER, GRAPHS, check_execution, model_execution, table_execution
from specbatch.perfmodel.tree import Strategy, Tree
from specbatch.runtime.generator import GenerationError, SpeculativeGenerator

from .config import TREE_AUTO, BenchConfig, BenchError, BenchModels, tree_from_spec
from .memory import check_bench_memory
from .peers import PeerModels, load_peers
from .policies import HF_ASSISTED, HF_GREEDY, BenchPolicy, bench_policies, tree_label
from .predict import Predictor, load_predictor, resolve_auto_tree
from .speed import MachineSpeed, machine_speed_for
from .workload import Workload, attended_context_len, cycled_prompts, round_prompts, timed_round_prompts


def balanced_order(items: Sequence[str], round_index: int) -> list[str]:
    """The order round `round_index` runs `items` in: a Williams design, balanced for position and for
    the policy run just before.

    A cyclic rotation (A B C D, B C D A, ...) puts every policy in every position but always after the
    same policy, so whatever a run leaves behind for the next one (allocator state, caches) always lands
    on the same neighbour. Row 0 here is 0, 1, n-1, 2, n-2, ...; row r adds r to each index (mod n). For
    an even n, n consecutive rounds put every policy once in every position and every ordered pair
    (x just before y) exactly once. For an odd n the next n rounds run the rows reversed, which completes
    the balance over 2n rounds.

    >>> [balanced_order(["a", "b", "c", "d"], r) for r in range(2)]
    [['a', 'b', 'd', 'c'], ['b', 'c', 'a', 'd']]
    """
    n = len(items)
    if n == 0:
        return []
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    row = [(index + round_index) % n for index in first]
    if n % 2 and (round_index // n) % 2:
        row.reverse()
    return [items[i] for i in row]


def check_context(models: BenchModels, prompts: Sequence[list[int]], config: BenchConfig, max_k: int) -> None:
    """Every run must fit the models' context: the longest prompt + max_new_tokens + the KV-cache margin
    of max_k speculative positions (the most draft tokens a step verifies: the largest k of --ks and of
    the table, or the largest tree's node count)."""
    if not prompts:
        raise BenchError("no prompts to benchmark with")
    limit = models.target.config.max_position_embeddings
    if models.draft is not None:
        limit = min(limit, models.draft.config.max_position_embeddings)
    longest = max(len(p) for p in cycled_prompts(prompts, max(config.batch_sizes)))
    if longest + config.max_new_tokens + max_k > limit:
        raise BenchError(
            f"longest prompt ({longest} tokens) + --max-new-tokens ({config.max_new_tokens}) + largest k or tree "
            f"({max_k} draft tokens, the KV-cache margin) exceeds the models' context of {limit} positions; lower "
            f"--max-new-tokens, k or the tree's size"
        )


def check_models(models: BenchModels, config: BenchConfig) -> None:
    """What the contenders need of the pair: a draft for k > 0 and trees, the n-gram model for --stage2."""
    if models.draft is None and max(config.fixed_ks) > 0:
        raise BenchError("k > 0 needs a draft model (--draft)")
    if models.draft is None and config.trees:
        raise BenchError("--tree needs a draft model (--draft)")
    if config.stage2_path is not None and models.stage2 is None:
        raise BenchError(f"--stage2 {config.stage2_path}: the n-gram model was not loaded (BenchModels.stage2)")
    if models.stage2 is not None:
        if models.draft is None:
            raise BenchError("--stage2 speeds up a draft model's drafting: it needs a draft model (--draft)")
        if config.synthetic_acceptance is not None:
            raise BenchError("--stage2 cannot be combined with --synthetic-acceptance: the runtime fakes "
                             "acceptance for plain chains only")


def check_table(table, models: BenchModels, config: BenchConfig) -> None:
    """A table whose entries use trees or the second stage needs what they need."""
    strategies = {entry.chosen() for bucket in table.table.buckets for entry in bucket.entries}
    shaped = [s for s in strategies if s.kind == "tree" or s.stage2]
    if shaped and config.synthetic_acceptance is not None:
        raise BenchError(f"--table {config.table_path}: it uses {shaped[0].describe(40)}; --synthetic-acceptance "
                         "fakes acceptance for plain chains only")
    if table.needs_stage2 and models.stage2 is None:
        raise BenchError(f"--table {config.table_path}: its entries use the n-gram second stage; pass --stage2 FILE")


def load_table(models: BenchModels, config: BenchConfig):
    """The --table policy (runtime.policy.TableK), checked against the pair; None without --table."""
    from specbatch.runtime.policy import TableK

    if config.table_path is None:
        return None
    table = TableK(config.table_path)
    if models.draft is None:
        raise BenchError("--table needs a draft model (--draft)")
    check_table(table, models, config)
    return table


def check_vllm_peer(table, models: BenchModels, config: BenchConfig) -> None:
    """--peers vllm: refused before measuring when vLLM is not set up or cannot run what we would compare."""
    from specbatch.calibrate.errors import CalibrationError
    from specbatch.calibrate.vllm_steps import vllm_method

    from .vllm.compare import VllmError, check_chains_only, vllm_missing

    if models.target_dir is None or models.draft_dir is None:
        raise BenchError("--peers vllm needs model directories for --target and --draft (vLLM loads the "
                         "checkpoints; shape presets have no weights)")
    head = getattr(models.draft, "head_config", None)  # a runtime.heads.DraftHead
    try:
        vllm_method("draft_model" if head is None else head.kind, models.draft_source)
    except CalibrationError as error:
        raise BenchError(f"--peers vllm: {error}") from None
    try:
        check_chains_only(table.table, f"--table {config.table_path}")
    except VllmError as error:
        raise BenchError(f"--peers vllm: {error}") from None
    if (missing := vllm_missing()) is not None:
        raise BenchError(f"--peers vllm: {missing}")


def plan_trees(config: BenchConfig, models: BenchModels, predictor: Predictor | None,
               prompts: Sequence[list[int]] | Workload) -> tuple[list[Tree], tuple[Tree, str] | None]:
    """The --tree trees, and what --tree auto became and why (None without it)."""
    trees, auto = [], None
    for spec in config.trees:
        if spec.strip() == TREE_AUTO:
            batches = timed_round_prompts(prompts, 1, config.warmup_rounds, config.rounds)
            context_len = attended_context_len(batches, config.max_new_tokens)
            auto = resolve_auto_tree(predictor, config.model_path, context_len, models.stage2 is not None)
            trees.append(auto[0])
        else:
            trees.append(tree_from_spec(spec))
    vocab = models.target.config.vocab_size
    for tree in trees:
        if tree.max_children > vocab:
            raise BenchError(f"--tree {tree_label(tree)}: a node has {tree.max_children} children, more than the "
                             f"vocabulary's {vocab} tokens")
    return trees, auto


def adaptive_policy(config: BenchConfig, models: BenchModels):
    """The adaptive contender: second-stage chains among its candidates when the run has the n-gram its
    model measured (checked by sha256), plain chains otherwise."""
    from specbatch.runtime.adaptive import adaptive_policy as load_adaptive
    from specbatch.runtime.assembly import check_stage2_file

    if models.draft is None:
        raise BenchError("--adaptive needs a draft model (--draft)")
    mode = "greedy" if config.sampling.greedy else "sampling"
    policy = load_adaptive(config.adaptive_path, staged=models.stage2 is not None, mode=mode,
                           refit=config.adaptive_refit)
    if policy.needs_stage2:
        if config.stage2_path is None:
            return load_adaptive(config.adaptive_path, staged=False, mode=mode, refit=config.adaptive_refit)
        check_stage2_file(config.stage2_path, policy.stage2_record["sha256"], "--adaptive's model measured")
    return policy


def check_plan_execution(config: BenchConfig, table, predictor: Predictor | None, adaptive, running: str) -> list[str]:
    """The execution rule (perfmodel.execution.check_execution), as serve applies it, for the files whose costs
    choose what runs (--table, --adaptive), against what this run's generator runs (`running`); a --model of the
    other execution only predicts, so it is a note: its prediction errors include the difference."""
    choosing = {f"--table {config.table_path}": table_execution(table.table.costs) if table is not None else None,
                f"--adaptive {config.adaptive_path}": adaptive.execution if adaptive is not None else None}
    for what, execution in choosing.items():
        if execution is not None:
            check_execution(what, execution, running, config.allow_mode_mismatch)
    predicting = model_execution(predictor.fitted) if predictor is not None else None
    if predicting is None or predicting == running:
        return []
    return [f"--model {config.model_path} holds costs of {predicting} passes but the runtime runs {running} passes "
            "here: its predictions are for the other runtime, and their errors include the difference"]


@dataclass
class BenchPlan:
    """Everything a bench run needs, checked and loaded: its contenders, prompts, the generator and peers."""

    config: BenchConfig
    models: BenchModels
    prompts: list[list[int]]  # every prompt the rounds can draw (context checks, prompt statistics)
    source: Sequence[list[int]] | Workload  # what the rounds draw their batches from
    policies: dict[str, BenchPolicy]  # ours, in run order
    generator: SpeculativeGenerator
    device: torch.device
    table: Any = None  # runtime.policy.TableK with --table
    adaptive: Any = None  # runtime.adaptive.AdaptivePolicy with --adaptive
    predictor: Predictor | None = None  # with --model
    speed: MachineSpeed | None = None  # the reference-pass check, when the model file kept calibration's
    peers: PeerModels | None = None  # transformers, with --peers transformers
    notes: list[str] = field(default_factory=list)

    def contenders(self, batch_size: int) -> list[str]:
        """Every contender at this batch size: ours, then the peers."""
        names = list(self.policies)
        if self.peers is not None:
            names.append(HF_GREEDY)
            if batch_size == 1 and self.peers.draft is not None:  # transformers refuses assisted generation above 1
                names.append(HF_ASSISTED)
        return names

    def batch_prompts(self, batch_size: int, round_index: int) -> list[list[int]]:
        """The batch of round `round_index` (negative: warm-up) at this batch size."""
        return round_prompts(self.source, batch_size, round_index, self.config.warmup_rounds, self.config.rounds)

    def timed_batches(self, batch_size: int) -> list[list[list[int]]]:
        """The batches of every timed round at this batch size."""
        return timed_round_prompts(self.source, batch_size, self.config.warmup_rounds, self.config.rounds)

    def run_count(self) -> int:
        """Generations the rounds will run, warm-ups included (extra paired rounds come on top)."""
        rounds = self.config.warmup_rounds + self.config.rounds
        return sum(len(self.contenders(b)) * rounds for b in self.config.batch_sizes)


def plan_bench(config: BenchConfig, models: BenchModels, prompts: Sequence[list[int]] | Workload) -> BenchPlan:
    """Check the run and load what it needs; everything that can be refused is refused here, before measuring.

    `prompts` are token ids, or a `bench.workload.Workload` (two populations, mixed or switched)."""
    every_prompt = prompts.prompts if isinstance(prompts, Workload) else [list(p) for p in prompts]
    if not every_prompt:
        raise BenchError("no prompts to benchmark with")
    notes: list[str] = []
    check_models(models, config)
    table = load_table(models, config)
    if "vllm" in config.peers:
        check_vllm_peer(table, models, config)
    predictor = None
    if config.model_path is not None:  # read before measuring: a bad file should fail in a second, not an hour
        predictor = load_predictor(config.model_path, config.sampling, config.synthetic_acceptance)
        notes.append(f"predictions use {predictor.acceptance_note}")
    trees, auto = plan_trees(config, models, predictor, prompts)
    adaptive = adaptive_policy(config, models) if config.adaptive_path is not None else None
    policies = bench_policies(config.fixed_ks, table, trees, stage2=models.stage2 is not None, adaptive=adaptive)
    if auto is not None:
        name = next(p.name for p in policies.values() if p.strategy == Strategy(auto[0]))
        notes.append(f"--tree auto became {name}, {auto[1]}")
    check_context(models, every_prompt, config, max(p.policy.max_k for p in policies.values()))
    device = models.target.lm_head.weight.device
    peers = None
    if "transformers" in config.peers:
        peers, note = load_peers(models, device)
        if note:
            notes.append(note)
    # EOS ignored on purpose: the batch must stay at b until max_new_tokens (bench.harness)
    try:
        generator = SpeculativeGenerator(models.target, models.draft, eos_token_ids=(), stage2=models.stage2,
                                         cuda_graphs=config.cuda_graphs)
    except GenerationError as error:
        raise BenchError(f"--stage2: {error}") from None
    if models.memory is not None:  # before the first cache is allocated: a batch size too large fails in one line
        longest = max(len(p) for p in every_prompt)  # the rounds cycle through them all
        check_bench_memory(models.memory, config.batch_sizes, [p.policy.max_k for p in policies.values()], longest,
                           config.max_new_tokens, config.interleave == "steps", generator.cuda_graphs)
    notes += check_plan_execution(config, table, predictor, adaptive, GRAPHS if generator.cuda_graphs else EAGER)
    speed = None  # the machine's speed against calibration's, when the model file has its reference pass
    if predictor is not None:
        speed = machine_speed_for(models.target, predictor.fitted.noise, device, config.model_path,
                                  graphs=generator.cuda_graphs)
    return BenchPlan(config=config, models=models, prompts=every_prompt, source=prompts, policies=policies,
                     generator=generator, device=device, table=table, adaptive=adaptive, predictor=predictor,
                     speed=speed, peers=peers, notes=notes)
