"""`specbatch demo` end to end on the bundled pair with a tiny race and a calibration that times each point
once, on one thread: every stage runs and leaves its files, the table it writes is a valid specbatch.table/1
the runtime can follow, and the generated text is what the target alone produces greedily on the same device
in the same dtype (the demo generates through the speculative path)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from lossless_helpers import divergences_at_near_ties
from specbatch import cli
from specbatch.calibrate import run as calibration
from specbatch.calibrate.timing import RepetitionRule
from specbatch.perfmodel.table import load_table
from specbatch.runtime.assembly import DEMO_TARGET
from specbatch.runtime.checkpoint import load_checkpoint
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK


# The quick calibration's grid and stages (trees, the n-gram stage, in-situ steps), each point timed once: this
# test checks the stages' wiring and the generation's losslessness, not the timings, and the quick effort's
# repetitions take most of a real demo's ~45 s.
ONE_LOOK = RepetitionRule(warmup_reps=0, min_reps=1, budget_s=0.0)
WIRING_EFFORT = replace(calibration.QUICK_EFFORT, forward_rule=ONE_LOOK, overhead_rule=ONE_LOOK, tree_rule=ONE_LOOK,
                        overhead_steps=1, tree_steps=1, prompt_count=4, continuation_tokens=16, insitu_ks=(0, 2),
                        insitu_tokens=8, insitu_sweeps=1)


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "QUICK_EFFORT", WIRING_EFFORT)
    out = tmp_path / "demo"
    result = CliRunner().invoke(cli.app, ["demo", "--out", str(out), "--batch-sizes", "1,2", "--rounds", "1",
                                          "--max-new-tokens", "12", "--prompts-shown", "2", "--max-batch", "8",
                                          "--threads", "1"])
    assert result.exit_code == 0, result.output
    for name in ("profile.json", "profile.csv", "model.json", "table.json", "table.csv", "vllm.json",
                 "trtllm.json", "generations.jsonl", "bench/bench.json", "bench/bench.csv"):
        assert (out / name).is_file(), name
    table = load_table(out / "table.json")
    assert [e.batch_size for e in table.buckets[0].entries] == list(range(1, 9))
    vllm = json.loads((out / "vllm.json").read_text())["num_speculative_tokens_per_batch_size"]
    assert vllm[0][0] == 1 and vllm[-1][1] == 8
    # the engines' exports rank the chains they run, not the trees and n-gram stage table.json may hold
    from specbatch.perfmodel.model import choose_acceptance, compute_table, load_model

    fitted = load_model(out / "model.json")
    chains = compute_table(fitted, choose_acceptance(fitted, None), 8, fitted.table_context_lens("vllm"),
                           strategies="chain")
    assert [k for start, end, k in vllm for _ in range(start, end + 1)] == [e.k for e in chains.buckets[0].entries]
    bench = json.loads((out / "bench" / "bench.json").read_text())
    assert [b["batch_size"] for b in bench["batch_sizes"]] == [1, 2]
    assert "median of 1 interleaved rounds" in " ".join(result.output.split())  # rich wraps long lines
    # stage 6: the demo head's own loop, its table made for it, its race
    for name in ("head-profile.json", "head-model.json", "head-table.json", "head-bench/bench.json"):
        assert (out / name).is_file(), name
    head_table = load_table(out / "head-table.json")
    assert head_table.drafter == "eagle3" and head_table.draft.endswith("demo-head")
    assert all(e.chosen().kind in ("none", "chain", "tree") for b in head_table.buckets for e in b.entries)
    head_bench = json.loads((out / "head-bench" / "bench.json").read_text())
    assert [b["batch_size"] for b in head_bench["batch_sizes"]] == [1, 2]
    assert "acceptance per draft position" in result.output and "head table " in result.output

    # the reference: the target alone, greedy, on the device and in the dtype the demo ran in (its profile's)
    device = json.loads((out / "profile.json").read_text())["device"]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[device["dtype"]]
    target = load_checkpoint(DEMO_TARGET, "cuda" if device["kind"] == "cuda" else "cpu", dtype)
    plain = SpeculativeGenerator(target.model, None, target.eos_token_ids)
    prompts, expected, shown_ids = [], [], []
    for line in (out / "generations.jsonl").read_text().splitlines():
        shown = json.loads(line)
        prompts.append(target.tokenizer.encode(shown["prompt"]))
        with torch.inference_mode():
            expected.append(plain.generate([prompts[-1]], 12, FixedK(0)).token_ids[0])
        shown_ids.append(shown["token_ids"])
    if dtype == torch.float32:  # exact: speculative greedy is plain greedy token for token
        assert shown_ids == expected
    else:  # bfloat16 on a GPU: rows may part from plain decoding only at near ties (tests/lossless_helpers.py)
        assert divergences_at_near_ties(target.model, prompts, expected, shown_ids)[1] == []
