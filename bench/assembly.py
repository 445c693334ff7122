"""Wiring a bench run from what a user names: the pair (directory, preset or config.json), the prompts
and the n-gram second stage. `specbatch bench` calls `load_bench_inputs` after its options are checked
(`BenchConfig` refuses bad ones before any model is loaded)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from specbatch.perfmodel.errors import UsageError
from specbatch.runtime.assembly import DEMO_PROMPTS, LOW_ACCEPTANCE_PROMPTS

from .config import BenchConfig, BenchModels
from .memory import bench_memory
from .workload import RANDOM_PROMPT_TOKENS, Workload, random_prompts


@dataclass
class BenchInputs:
    config: BenchConfig  # the run's config, with the table's own n-gram when the table names one
    models: BenchModels
    token_prompts: list[list[int]] | Workload  # a Workload for --workload mixed | switch
    notes: list[str] = field(default_factory=list)  # said in front of the result's own notes


def check_input_files(**paths: Path | None) -> None:
    """Each named file exists (checked before anything is loaded); the keyword names the option."""
    for name, path in paths.items():
        if path is not None and not Path(path).is_file():
            raise UsageError(f"--{name.replace('_', '-')} {path}: no such file")


def load_bench_inputs(config: BenchConfig, target: str | None, draft: str | None, prompts: Path | None,
                      device: str | None, dtype: str | None, force: bool = False) -> BenchInputs:
    """Check that the table and model files were made for this pair (`force` overrides), load the pair on
    the device, encode the prompts (random token prompts for a pair without a tokenizer) and load the
    second stage (`config`'s, else the one the table names), checked against the target's vocabulary (a head as
    --draft takes none: `check_head_stage2`)."""
    from specbatch.calibrate.acceptance import read_prompts
    from specbatch.calibrate.models import named_pair
    from specbatch.runtime.assembly import check_head_stage2, files_for_pair
    from specbatch.runtime.checkpoint import parse_dtype
    from specbatch.runtime.loading import load_ngram, load_pair, resolve_device, resolve_pair, running_pair

    target_spec, draft_spec = resolve_pair(*named_pair(target, draft, "bench"))
    running = running_pair(target_spec, draft_spec)
    check_head_stage2(draft_spec, config.stage2_path)
    notes = []
    stage2 = files_for_pair(config.table_path, config.model_path, config.stage2_path, running, force,
                            adaptive=config.adaptive_path)
    if stage2 != config.stage2_path:  # the table's own n-gram: its staged policies run too
        config = dataclasses.replace(config, stage2_path=stage2)
    random_weights = target_spec.random_weights or draft_spec.random_weights
    if random_weights and config.synthetic_acceptance is None:
        raise UsageError("random weights (a preset or config.json) never agree with a target: pass "
                         "--synthetic-acceptance α to benchmark the shape")
    device = resolve_device(device)
    torch_dtype = parse_dtype(dtype, device)
    memory = bench_memory(target_spec, draft_spec, device, torch_dtype)  # before loading: what is free for the run
    pair = load_pair(target_spec, draft_spec, device, torch_dtype)
    # each round of batch size b takes the next b prompts (cycling), so small batches see many prompts
    needed = max(config.batch_sizes) * (config.rounds + config.warmup_rounds)
    if pair.tokenizer is not None:
        texts = read_prompts(prompts or DEMO_PROMPTS, "--prompts")[:needed]  # fewer are cycled
        token_prompts = [pair.tokenizer.encode(text) for text in texts]
        if config.workload != "heldout":
            second = config.second_prompts_path or LOW_ACCEPTANCE_PROMPTS
            others = [pair.tokenizer.encode(text) for text in read_prompts(second, "--second-prompts")[:needed]]
            token_prompts = Workload(config.workload, tuple(map(tuple, token_prompts)), tuple(map(tuple, others)))
            notes.append(f"workload {config.workload}: {prompts or DEMO_PROMPTS} and {second}")
    elif config.workload != "heldout":
        raise UsageError(f"--workload {config.workload}: {target_spec.source} has no tokenizer.json to encode the "
                         "two prompt populations")
    elif prompts is not None:
        raise UsageError(f"--prompts: {target_spec.source} has no tokenizer.json to encode text; leave --prompts "
                         "out to benchmark with random token prompts")
    else:
        token_prompts = random_prompts(needed, RANDOM_PROMPT_TOKENS, target_spec.config.vocab_size, config.seed)
        notes.append(f"prompts: {needed} random sequences of {RANDOM_PROMPT_TOKENS} tokens (no tokenizer)")
    ngram = None if config.stage2_path is None else load_ngram(config.stage2_path, "--stage2", target_spec)
    models = BenchModels(target=pair.target, draft=pair.draft, target_source=target_spec.source,
                         draft_source=draft_spec.source, target_dir=target_spec.directory,
                         draft_dir=draft_spec.directory, random_weights=random_weights, stage2=ngram, memory=memory)
    return BenchInputs(config, models, token_prompts, notes)
