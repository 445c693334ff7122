"""`run_bench`: every contender (`policies.py`) at every batch size, in interleaved rounds.

A run is planned (`plan.py`: contenders, prompts, checks), its rounds run (`rounds.py`) and summarized here.
It assumes a constant batch size: EOS is ignored and every row generates `max_new_tokens`, so the batch
stays at b until rows that sped ahead under speculation finish (`full_batch_step_fraction` says how long).
Within a round every policy gets the same prompts and seed; rounds differ in both. One warm-up round per
batch size (first use of every tensor shape) is discarded.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from specbatch.calibrate.environment import device_name
from specbatch.runtime.model import CausalLM

from .config import BenchConfig, BenchModels
from .explain_steps import add_explanations
from .plan import BenchPlan, plan_bench
from .policies import ADAPTIVE_POLICY, HF_ASSISTED, HF_GREEDY, TABLE_POLICY, fixed_policy_name, table_strategy
from .predict import add_predictions
from .regret import add_adaptive_comparison, add_paired_regret
from .results import BatchResult, BenchResult, RunRecord, most_frequent_k, summarize_batch, summarize_policy
from .rounds import BenchInterrupted, complete_rounds, run_rounds, run_vllm_peer
from .speed import add_machine_speed
from .workload import Workload, attended_context_len


def run_bench(config: BenchConfig, models: BenchModels, prompts: Sequence[list[int]] | Workload,
              on_run: Callable[[RunRecord, int, int], None] | None = None,
              on_plan: Callable[[BenchPlan], None] | None = None) -> BenchResult:
    """Measure every policy at every batch size in interleaved rounds.

    `prompts` are token ids, or a `bench.workload.Workload` (two populations, mixed or switched); batch
    size b takes the next b of them every round (cycling). `on_plan(plan)` is called once the run is
    planned, before the first generation; `on_run(record, done, total)` after every generation (the CLI's
    progress). Everything that can be refused is refused before measuring. Interrupted (Ctrl-C), the
    result holds the batch sizes with a finished round and says so (`interrupted`); with none, the
    KeyboardInterrupt goes on.
    """
    plan = plan_bench(config, models, prompts)
    if on_plan is not None:
        on_plan(plan)
    try:
        runs, notes = run_rounds(plan, on_run)
    except BenchInterrupted as stop:
        runs, measured = complete_rounds(plan, stop.runs)
        if not measured:
            raise KeyboardInterrupt from None
        left = [b for b in config.batch_sizes if b not in measured]
        note = (f"interrupted: batch sizes {', '.join(map(str, measured))} measured (their finished rounds)"
                + (f", {', '.join(map(str, left))} not" if left else ""))
        result = summarize_bench(plan, runs, stop.notes + [note], batch_sizes=measured)
        result.interrupted = True
        return result
    vllm = run_vllm_peer(plan)
    return summarize_bench(plan, runs, notes, vllm)


def summarize_bench(plan: BenchPlan, runs: list[RunRecord], round_notes: list[str], vllm: Any = None,
                    batch_sizes: Sequence[int] | None = None) -> BenchResult:
    """The result of a run: every batch size's summary (of `batch_sizes`, default the config's), the paired
    regret and adaptive comparison, the performance model's predictions and their decomposition when a
    model file was given."""
    config, models = plan.config, plan.models
    notes = plan.notes + round_notes
    batches = [batch_result(plan, b, runs) for b in (config.batch_sizes if batch_sizes is None else batch_sizes)]
    fixed_names = {k: fixed_policy_name(k) for k in config.fixed_ks}
    if plan.table is not None:
        add_paired_regret(batches, runs, fixed_names, TABLE_POLICY)
    if plan.adaptive is not None:
        add_adaptive_comparison(batches, runs, ADAPTIVE_POLICY, TABLE_POLICY, fixed_names,
                                (config.rounds + 1) // 2 if config.workload == "switch" else None)
    if plan.predictor is not None:
        notes += add_predictions(batches, plan.predictor, plan.policies, runs)
        if plan.speed is not None:
            add_machine_speed(batches, plan.speed)
        notes += add_explanations(batches, runs, plan.predictor, plan.policies)
    prompt_lens = [len(p) for p in plan.prompts]
    return BenchResult(
        config=config, device=device_info(models.target),
        models={"target": model_info(models.target, models.target_source, models.random_weights),
                "draft": model_info(models.draft, models.draft_source, models.random_weights),
                "peers": {"transformers_version": plan.peers.transformers_version} if plan.peers else None,
                "stage2": stage2_info(models.stage2, config.stage2_path)},
        prompts={"count": len(plan.prompts), "min_tokens": min(prompt_lens), "max_tokens": max(prompt_lens)},
        batches=batches, runs=runs, notes=notes, vllm=vllm,
    )


def batch_result(plan: BenchPlan, b: int, runs: list[RunRecord]) -> BatchResult:
    """One batch size's summary over its timed rounds; the table's strategy at the run's mean context."""
    config = plan.config
    timed = [r for r in runs if r.batch_size == b and not r.warmup]
    context_len = attended_context_len(plan.timed_batches(b), config.max_new_tokens)
    results = []
    for name in plan.contenders(b):
        records = [r for r in timed if r.policy == name]
        ours = plan.policies.get(name)
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


def device_info(model: CausalLM) -> dict[str, Any]:
    weight = model.lm_head.weight
    return {"kind": weight.device.type, "name": device_name(str(weight.device)),
            "dtype": str(weight.dtype).removeprefix("torch."), "torch_version": torch.__version__,
            "cpu_threads": torch.get_num_threads()}


def model_info(model: CausalLM | None, source: str | None, random_weights: bool) -> dict[str, Any] | None:
    """bench.json's record of a model, or of a head (its kind as `drafter`, the parameters its passes read)."""
    if model is None:
        return None
    config = model.config
    head = getattr(model, "head_config", None)  # a runtime.heads.DraftHead
    if head is not None:
        return {"source": source, "model_type": config.model_type, "drafter": head.kind,
                "random_weights": random_weights, "parameters": head.parameter_count(), "layers": 1,
                "hidden_size": head.hidden_size, "vocab_size": config.vocab_size,
                "draft_vocab_size": head.draft_vocab_size}
    return {"source": source, "model_type": config.model_type, "random_weights": random_weights,
            "parameters": config.parameter_count(), "layers": config.num_layers, "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size}


def stage2_info(stage2, path: Path | None) -> dict[str, Any] | None:
    if stage2 is None:
        return None
    return {"file": str(path) if path is not None else None, "vocab_size": stage2.vocab_size,
            "note": dict(getattr(stage2, "note", {}))}
