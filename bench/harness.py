"""`run_bench`: every contender (`policies.py`) at every batch size, in interleaved rounds.

How the measurement is kept honest:
  * Interleaved rounds. Each round runs every policy once, in an order balanced for position and for
    the policy run just before (`balanced_order`, a Williams design), so slow drift of a shared machine
    (thermal state, a background job) and whatever a run leaves behind for the next spread over all
    policies instead of picking the winner. Within a round our policies run in lockstep by default, a
    step of each in turn (`bench.timing.time_lockstep`, calibrate.lockstep), so they meet the same
    spells of a CPU whose speed changes every few seconds; the balanced order breaks their ties. One
    warm-up round per batch size runs first and is discarded: each (policy, b) has its own tensor
    shapes, whose first use pays allocator (and, on CUDA, kernel-selection) costs that steady-state
    serving does not.
  * Constant batch size. EOS is ignored (the generator gets `eos_token_ids=()`) and every row asks
    for the same `max_new_tokens`, so no row leaves the batch early because its text ended. Rows
    still advance at different speeds under speculation (they accept different numbers of tokens),
    so the batch thins out in the last few steps; `full_batch_step_fraction` reports how much of a
    run really ran at b, and the table's k is read from the full-batch steps only.
  * Common random numbers. Within a round all policies use the same seed (sampling and synthetic
    acceptance draw from it); rounds use different seeds so the spread covers that randomness.
  * Settled regret. At b <= RESOLVE_MAX_BATCH, when the table's paired regret (bench.regret) straddles
    the 3 % goal after the rounds, or its interval is wider than ±3 %, extra rounds of the table and the
    best fixed k alone run until it is settled or `resolve_rounds` is spent (`regret.resolve_regret`).
  * Peers. transformers' generate joins the rounds as another contender; vLLM (`--peers vllm`) runs
    after them, in its own environment, interleaved with our k = 0 and table round by round on the
    same prompts (bench/vllm/compare.py).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from specbatch.calibrate.environment import device_name
from specbatch.perfmodel.tree import Strategy
from specbatch.runtime.generator import GenerationError, SpeculativeGenerator
from specbatch.runtime.model import CausalLM

from .config import TREE_AUTO, BenchConfig, BenchError, BenchModels, tree_from_spec
from .peers import load_peers, time_peer
from .policies import (
    ADAPTIVE_POLICY,
    HF_ASSISTED,
    HF_GREEDY,
    TABLE_POLICY,
    BenchPolicy,
    bench_policies,
    fixed_policy_name,
    table_strategy,
    tree_label,
)
from .predict import add_predictions, load_predictor, resolve_auto_tree
from .results import BatchResult, BenchResult, RunRecord, most_frequent_k, summarize_batch, summarize_policy
from .timing import time_lockstep, time_ours
from .workload import Workload

# Prompt length for models without a tokenizer (presets): about the held-out demo prompts' median
# (70 bytes, one token per byte with the demo pair's byte-level tokenizer).
RANDOM_PROMPT_TOKENS = 64
# Extra paired rounds (`resolve_regret`): up to --resolve-rounds at small batch sizes, where a round costs
# little and the table's choice matters most; above, at most as many generations as the batch size's own
# rounds ran (rounds x contenders / 2 pairs), so a large batch size's time at most doubles (a b = 32 round
# of two generations took about 3 s on the demo pair, one CPU thread).
RESOLVE_MAX_BATCH = 8


def random_prompts(count: int, length_tokens: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids, for models without a tokenizer (presets): the text is irrelevant to timing."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length_tokens), generator=gen).tolist()


def cycled_prompts(prompts: Sequence[list[int]], batch_size: int, offset: int = 0) -> list[list[int]]:
    """`batch_size` prompts from `offset` on, cycling through the list (deterministic). Each round
    takes the next slice, so a small batch size is measured on many prompts, not on one."""
    if not prompts:
        raise BenchError("no prompts to benchmark with")
    return [list(prompts[(offset + i) % len(prompts)]) for i in range(batch_size)]


def timed_round_prompts(prompts: Sequence[list[int]], batch_size: int, config: BenchConfig) -> list[list[list[int]]]:
    """The prompts of every timed round at one batch size (each round takes the next batch_size)."""
    return [cycled_prompts(prompts, batch_size, offset=(r + config.warmup_rounds) * batch_size)
            for r in range(config.rounds)]


def attended_context_len(round_prompts: Sequence[Sequence[list[int]]], max_new_tokens: int) -> int:
    """The context every row's attention pays for, averaged over a run and over rounds: the runtime's
    attention spans the longest row of the batch (shorter rows are masked, not skipped), so it is the
    longest prompt of each round plus half the generated tokens."""
    longest = [max(len(p) for p in prompts) for prompts in round_prompts]
    return round(sum(longest) / len(longest) + max_new_tokens / 2)


def balanced_order(items: Sequence[str], round_index: int) -> list[str]:
    """The order round `round_index` runs `items` in: a Williams design, balanced for position and for
    the policy run just before.

    A cyclic rotation (A B C D, B C D A, ...) puts every policy in every position but always after the
    same policy (D after C in every round but one), so whatever a run leaves behind for the next one
    (allocator state, caches, a wide pass's memory) always lands on the same neighbour. Row 0 here is
    0, 1, n-1, 2, n-2, ...; row r adds r to each index (mod n). For an even n, n consecutive rounds put
    every policy once in every position and every ordered pair (x just before y) exactly once. For an
    odd n the next n rounds run the rows reversed, which completes the balance over 2n rounds.

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


def check_table(table, models: BenchModels, config: BenchConfig) -> None:
    """A table whose entries use trees or the second stage needs what they need."""
    strategies = {entry.chosen() for bucket in table.table.buckets for entry in bucket.entries}
    shaped = [s for s in strategies if s.kind == "tree" or s.stage2]
    if shaped and config.synthetic_acceptance is not None:
        raise BenchError(f"--table {config.table_path}: it uses {shaped[0].describe(40)}; --synthetic-acceptance "
                         "fakes acceptance for plain chains only")
    if table.needs_stage2 and models.stage2 is None:
        raise BenchError(f"--table {config.table_path}: its entries use the n-gram second stage; pass --stage2 FILE")


def run_bench(config: BenchConfig, models: BenchModels, prompts: Sequence[list[int]],
              on_run: Callable[[RunRecord, int, int], None] | None = None) -> BenchResult:
    """Measure every policy at every batch size in interleaved rounds; see the module docstring.

    `prompts` are token ids, or a `bench.workload.Workload` (two populations, mixed or switched); batch
    size b uses the first b of them (cycling). EOS is ignored and every
    row generates exactly `max_new_tokens`, so the batch stays at b until rows that sped ahead under
    speculation finish (`full_batch_step_fraction` says how long). `on_run(record, done, total)` is
    called after every generation (the CLI's progress bar). Everything that can be refused (a missing
    draft or n-gram model, a bad model file, --tree auto's resolution) is refused before measuring.
    """
    from specbatch.runtime.policy import TableK

    workload = prompts if isinstance(prompts, Workload) else None
    if workload is not None:
        prompts = workload.prompts

    def round_prompts(b: int, round_index: int) -> list[list[int]]:
        """The batch of round `round_index` (negative: warm-up) at batch size b."""
        if workload is not None:
            return workload.batch(b, round_index + config.warmup_rounds, config.warmup_rounds, config.rounds)
        return cycled_prompts(prompts, b, offset=(round_index + config.warmup_rounds) * b)

    def timed_rounds(b: int) -> list[list[list[int]]]:
        return [round_prompts(b, r) for r in range(config.rounds)]

    notes: list[str] = []
    fixed_ks = config.fixed_ks
    if models.draft is None and max(fixed_ks) > 0:
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
    table = TableK(config.table_path) if config.table_path is not None else None
    if table is not None and models.draft is None:
        raise BenchError("--table needs a draft model (--draft)")
    if table is not None:
        check_table(table, models, config)
    if "vllm" in config.peers:
        check_vllm_peer(table, models, config)
    predictor = None
    if config.model_path is not None:  # read before measuring: a bad file should fail in a second, not an hour
        predictor = load_predictor(config.model_path, config.sampling, config.synthetic_acceptance)
        notes.append(f"predictions use {predictor.acceptance_note}")
    trees, auto = [], None  # auto: (the tree --tree auto became, why)
    for spec in config.trees:
        if spec.strip() == TREE_AUTO:
            context_len = attended_context_len(timed_rounds(1), config.max_new_tokens)
            auto = resolve_auto_tree(predictor, config.model_path, context_len, models.stage2 is not None)
            trees.append(auto[0])
        else:
            trees.append(tree_from_spec(spec))
    vocab = models.target.config.vocab_size
    for tree in trees:
        if tree.max_children > vocab:
            raise BenchError(f"--tree {tree_label(tree)}: a node has {tree.max_children} children, more than the "
                             f"vocabulary's {vocab} tokens")

    adaptive = None
    if config.adaptive_path is not None:
        if models.draft is None:
            raise BenchError("--adaptive needs a draft model (--draft)")
        adaptive = _adaptive_policy(config, models)
    policies = bench_policies(fixed_ks, table, trees, stage2=models.stage2 is not None, adaptive=adaptive)
    if auto is not None:
        name = next(p.name for p in policies.values() if p.strategy == Strategy(auto[0]))
        notes.append(f"--tree auto became {name}, {auto[1]}")
    check_context(models, prompts, config, max(p.policy.max_k for p in policies.values()))
    device = models.target.lm_head.weight.device
    peers = None
    if "transformers" in config.peers:
        peers, note = load_peers(models, device)
        if note:
            notes.append(note)
    # EOS ignored on purpose: the batch must stay at b until max_new_tokens (module docstring)
    try:
        generator = SpeculativeGenerator(models.target, models.draft, eos_token_ids=(), stage2=models.stage2)
    except GenerationError as error:
        raise BenchError(f"--stage2: {error}") from None

    def contenders(b: int) -> list[str]:
        names = list(policies)
        if peers is not None:
            names.append(HF_GREEDY)
            if b == 1 and peers.draft is not None:  # transformers refuses assisted generation above b = 1
                names.append(HF_ASSISTED)
        return names

    total = sum(len(contenders(b)) * (config.warmup_rounds + config.rounds) for b in config.batch_sizes)
    runs: list[RunRecord] = []

    speed = None  # the machine's speed against calibration's, when the model file has its reference pass
    if predictor is not None:
        from .speed import machine_speed_for

        speed = machine_speed_for(models.target, predictor.fitted.noise, device, config.model_path)

    def run_round(b: int, round_index: int, names: list[str]) -> None:
        nonlocal total
        if speed is not None and round_index >= 0:
            speed.check(b)
        seed = config.seed + round_index + config.warmup_rounds  # the same for every policy in a round
        batch_prompts = round_prompts(b, round_index)
        order = balanced_order(names, round_index)
        together = [name for name in order if name in policies] if config.interleave == "steps" else []
        measured = {}
        if len(together) > 1:  # ours in lockstep (bench.timing), then the peers back to back
            measured = time_lockstep(generator, batch_prompts, [(name, policies[name].policy) for name in together],
                                     config, seed)
            order = together + [name for name in order if name not in policies]
        for name in order:
            if name not in measured:
                measured[name] = time_ours(generator, batch_prompts, policies[name].policy, config, seed) \
                    if name in policies else time_peer(peers, name, batch_prompts, config, seed, device)
            runs.append(RunRecord(batch_size=b, round=round_index, policy=name, **measured[name]))
            total = max(total, len(runs))
            if on_run is not None:
                on_run(runs[-1], len(runs), total)

    # warnings raised while measuring (e.g. a batch size beyond the table) become notes in the result
    # instead of lines in the middle of the progress bar
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for b in config.batch_sizes:
            for round_index in range(-config.warmup_rounds, config.rounds):
                run_round(b, round_index, contenders(b))
            if speed is not None:
                speed.check(b)  # after the last round too: the rounds are bracketed
            # not on `switch`: every extra round would come from the second population, tilting the pairs
            if table is not None and config.resolve_rounds and config.workload != "switch":
                from .regret import resolve_regret

                cap = None if b <= RESOLVE_MAX_BATCH else config.rounds * len(contenders(b)) // 2
                notes += resolve_regret(b, runs, config, fixed_ks, lambda r, pair: run_round(b, r, pair), cap)
    notes += list(dict.fromkeys(f"warning: {w.message}" for w in caught))

    batches = [_batch_result(b, contenders(b), runs, config, timed_rounds(b), policies)
               for b in config.batch_sizes]
    if table is not None:
        from .regret import add_paired_regret

        add_paired_regret(batches, runs, {k: fixed_policy_name(k) for k in fixed_ks}, TABLE_POLICY)
    if adaptive is not None:
        from .regret import add_adaptive_comparison

        fixed_names = {k: fixed_policy_name(k) for k in fixed_ks}
        add_adaptive_comparison(batches, runs, ADAPTIVE_POLICY, TABLE_POLICY, fixed_names,
                                (config.rounds + 1) // 2 if config.workload == "switch" else None)
    if predictor is not None:
        from .explain_steps import add_explanations

        notes += add_predictions(batches, predictor, policies, runs)
        if speed is not None:
            from .speed import add_machine_speed

            add_machine_speed(batches, speed)
        notes += add_explanations(batches, runs, predictor, policies)
    vllm = None
    if "vllm" in config.peers:
        from .vllm.compare import VllmError, compare

        try:
            vllm = compare(config.table_path, list(prompts), list(config.batch_sizes), config.max_new_tokens,
                           config.rounds, models.target_dir, models.draft_dir, generator=generator)
        except VllmError as error:
            raise BenchError(f"--peers vllm: {error}") from None
    prompt_lens = [len(p) for p in prompts]
    return BenchResult(
        config=config, device=device_info(models.target),
        models={"target": _model_info(models.target, models.target_source, models.random_weights),
                "draft": _model_info(models.draft, models.draft_source, models.random_weights),
                "peers": {"transformers_version": peers.transformers_version} if peers else None,
                "stage2": _stage2_info(models.stage2, config.stage2_path)},
        prompts={"count": len(prompts), "min_tokens": min(prompt_lens), "max_tokens": max(prompt_lens)},
        batches=batches, runs=runs, notes=notes, vllm=vllm,
    )


def _adaptive_policy(config: BenchConfig, models: BenchModels):
    """The adaptive contender: second-stage chains among its candidates when the run has the n-gram its
    model measured (checked by sha256), plain chains otherwise."""
    from specbatch.runtime.adaptive import adaptive_policy
    from specbatch.runtime.assembly import check_stage2_file

    policy = adaptive_policy(config.adaptive_path, staged=models.stage2 is not None,
                             mode="greedy" if config.sampling.greedy else "sampling",
                             early_stop=config.adaptive_draft_stop)
    if policy.needs_stage2:
        if config.stage2_path is None:
            return adaptive_policy(config.adaptive_path, staged=False, early_stop=config.adaptive_draft_stop)
        check_stage2_file(config.stage2_path, policy.stage2_record["sha256"], "--adaptive's model measured")
    return policy


def check_vllm_peer(table, models: BenchModels, config: BenchConfig) -> None:
    """--peers vllm: refused before measuring when vLLM is not set up or cannot run what we would compare."""
    from .vllm.compare import VllmError, check_chains_only, vllm_missing

    if models.target_dir is None or models.draft_dir is None:
        raise BenchError("--peers vllm needs model directories for --target and --draft (vLLM loads the "
                         "checkpoints; shape presets have no weights)")
    try:
        check_chains_only(table.table, f"--table {config.table_path}")
    except VllmError as error:
        raise BenchError(f"--peers vllm: {error}") from None
    if (missing := vllm_missing()) is not None:
        raise BenchError(f"--peers vllm: {missing}")


def device_info(model: CausalLM) -> dict[str, Any]:
    weight = model.lm_head.weight
    return {"kind": weight.device.type, "name": device_name(str(weight.device)),
            "dtype": str(weight.dtype).removeprefix("torch."), "torch_version": torch.__version__,
            "cpu_threads": torch.get_num_threads()}


def _model_info(model: CausalLM | None, source: str | None, random_weights: bool) -> dict[str, Any] | None:
    if model is None:
        return None
    config = model.config
    return {"source": source, "model_type": config.model_type, "random_weights": random_weights,
            "parameters": config.parameter_count(), "layers": config.num_layers, "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size}


def _stage2_info(stage2, path: Path | None) -> dict[str, Any] | None:
    if stage2 is None:
        return None
    return {"file": str(path) if path is not None else None, "vocab_size": stage2.vocab_size,
            "note": dict(getattr(stage2, "note", {}))}


def _batch_result(b: int, names: list[str], runs: list[RunRecord], config: BenchConfig,
                  round_prompts: list[list[list[int]]], policies: dict[str, BenchPolicy]) -> BatchResult:
    timed = [r for r in runs if r.batch_size == b and not r.warmup]
    context_len = attended_context_len(round_prompts, config.max_new_tokens)
    results = []
    for name in names:
        records = [r for r in timed if r.policy == name]
        ours = policies.get(name)
        if ours is None:  # a peer
            k, strategy = None, None
        elif name == ADAPTIVE_POLICY:  # its strategy changes step by step: the most frequent k is shown
            k, strategy = most_frequent_k(records), "adaptive"
        elif ours.strategy is None:  # the table
            k, strategy = most_frequent_k(records), table_strategy(ours.policy, b, context_len).describe()
        else:
            k, strategy = ours.strategy.k, ours.strategy.describe()
        results.append(summarize_policy(name, k, records, strategy))
    return summarize_batch(b, context_len, results, config.fixed_ks,
                           has_peers=any(r.policy in (HF_GREEDY, HF_ASSISTED) for r in timed))
