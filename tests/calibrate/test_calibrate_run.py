"""End to end on a tiny real pair: the profile and its CSV, interrupt and resume, and every bad input
through the CLI (one line, exit code 2, no traceback). Runs use --quick and a grid of a few points."""
from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from specbatch import cli
from specbatch.calibrate.errors import CalibrationError
from specbatch.calibrate.grid import TimingPoint
from specbatch.calibrate.run import DEFAULT_EFFORT, QUICK_EFFORT, CalibrationRequest, calibrate
from specbatch.calibrate.stage2 import DEMO_DRAFT, DEMO_NGRAM, default_stage2
from specbatch.calibrate.store import new_profile, timing_row, with_row, write_profile
from specbatch.perfmodel.errors import SpecbatchError
from specbatch.perfmodel.profile import load_profile
from specbatch.runtime.checkpoint import build_model
from specbatch.runtime.ngram import NGramModel, tokenizer_fingerprint

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def add(a, b):\n", "class Stack:\n    def push(self, item):\n", "import os\n", "x = [i * i for i in",
           "def main():\n    \"\"\"Entry point.\"\"\"\n", "for key, value in items.items():\n"]


def _export_function():
    """The demo pair's own exporter (Hugging Face layout + byte-level tokenizer.json)."""
    spec = importlib.util.spec_from_file_location("train_demo_pair", ROOT / "data" / "train_demo_pair.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.export, module.TARGET


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny byte-level Llama pair on disk (real weights, tokenizer), and a prompts file."""
    export, demo = _export_function()
    root = tmp_path_factory.mktemp("pair")
    target = replace(demo, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     intermediate_size=64, max_position_embeddings=160)
    draft = replace(target, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32)
    export(build_model(target, seed=1), target, root / "target")
    export(build_model(draft, seed=2), draft, root / "draft")
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    sequences = np.random.default_rng(0).integers(0, target.vocab_size, size=(20, 200))
    fingerprint = tokenizer_fingerprint(root / "target" / "tokenizer.json")
    NGramModel.fit(sequences, target.vocab_size, fingerprint).save(root / "ngram.safetensors")
    NGramModel.fit(sequences, target.vocab_size, "0" * 64).save(root / "other-tokenizer.safetensors")
    NGramModel.fit(sequences[:, :100] % 100, 100, fingerprint).save(root / "small-vocab.safetensors")
    return root


def request(pair: Path, out: Path, **overrides) -> CalibrationRequest:
    fields = dict(target=str(pair / "target"), draft=str(pair / "draft"), out=out, device="cpu",
                  batch_sizes=(1, 2), context_lens=(16,), max_k=2, prompts=pair / "prompts.jsonl", quick=True)
    fields.update(overrides)
    return CalibrationRequest(**fields)


@pytest.fixture(scope="module")
def measured(pair, tmp_path_factory):
    """One complete calibration with greedy and one sampling setting, and the second stage."""
    out = tmp_path_factory.mktemp("measured") / "profile.json"
    summary = calibrate(request(pair, out, samplings=("T=1.0",), stage2=pair / "ngram.safetensors"))
    return out, summary


TIMINGS = 2 * ((3 + 3) + (2 + 5))  # b = 1, 2: target n = 1..3 and 16, 32, 64; draft n = 1, 2 and 4..64
TREE_ROWS = 2 * 2 * 2  # b = 1, 2 x trees of 12 and 32 nodes x without and with the second stage
INSITU_CELLS = {(1, 0), (1, 2), (2, 0), (2, 2)}  # b = 1 (every other) and 2 (the largest) x quick's k <= max_k
INSITU = len(INSITU_CELLS) * 2  # one generation per cell in each of quick's 2 sweeps


# ---------------------------------------------------------------- the profile
def test_profile_has_every_point_and_round_trips(measured):
    out, summary = measured
    profile = load_profile(out)  # perfmodel's strict reader: schema, types, duplicates
    assert profile.to_json() == json.loads(out.read_text())
    assert len(profile.timings) == TIMINGS and all(row.feasible for row in profile.timings)
    chain_rows = [r for r in profile.overheads if r.tree_nodes is None]
    assert {(r.batch_size, r.k) for r in chain_rows} == {(b, k) for b in (1, 2) for k in range(3)}
    assert all(row.reps >= 3 and row.p10_ms <= row.median_ms <= row.p90_ms for row in profile.timings)
    assert profile.grid.target_new_tokens == (1, 2, 3, 16, 32, 64)
    assert profile.grid.draft_new_tokens == (1, 2, 4, 8, 16, 32, 64)
    assert [(e.mode, e.source, e.prompt_count) for e in profile.acceptance] == \
        [("greedy", "measured", 6), ("sampling", "measured", 6)]
    assert all(len(e.per_position) == 2 and 0 <= min(e.per_position) for e in profile.acceptance)
    assert profile.target.layers == 2 and profile.draft.layers == 1 and not profile.target.random_weights
    assert profile.device.kind == "cpu" and profile.device.dtype == "float32"
    assert summary.points_measured == 2 + 1 + TIMINGS + 6 + TREE_ROWS + INSITU and summary.points_resumed == 0


def test_profile_has_what_trees_and_the_second_stage_need(pair, measured):
    out, summary = measured
    profile = load_profile(out)
    for entry in profile.acceptance:  # max_k x R, each row a distribution's part
        assert len(entry.rank_acceptance) == 2 and all(len(row) == 4 for row in entry.rank_acceptance)
        assert all(0 <= min(row) and sum(row) <= 1 + 1e-9 for row in entry.rank_acceptance)
    stage2 = profile.stage2
    assert stage2.file.endswith("ngram.safetensors") and len(stage2.guess_accuracy) == 4
    assert stage2.sha256 == hashlib.sha256((pair / "ngram.safetensors").read_bytes()).hexdigest()
    assert all(0 <= a <= 1 for a in stage2.guess_accuracy)
    assert stage2.query_overhead_ms >= 0 and stage2.query_ms_per_context >= 0
    trees = [r for r in profile.overheads if r.tree_nodes is not None]
    assert {(r.batch_size, r.tree_nodes, r.stage2) for r in trees} == \
        {(b, n, s) for b in (1, 2) for n in QUICK_EFFORT.tree_nodes for s in (False, True)}
    assert all(r.k == 2 and r.reps >= 3 and r.median_ms > 0 for r in trees)  # grown to the full depth, max_k
    assert summary.tree_overheads == TREE_ROWS and summary.stage2.guess_accuracy == stage2.guess_accuracy
    assert summary.acceptance[0].rank_acceptance == profile.acceptance[0].rank_acceptance


def test_csv_holds_the_timing_rows(measured):
    out, _ = measured
    with open(out.with_suffix(".csv"), newline="") as file:
        rows = list(csv.DictReader(file))
    profile = load_profile(out)
    assert len(rows) == len(profile.timings)
    for row, timing in zip(rows, profile.timings):
        assert (row["model"], int(row["batch_size"]), int(row["new_tokens"]), int(row["context_len"])) == \
            (timing.model, timing.batch_size, timing.new_tokens, timing.context_len)
        assert float(row["median_ms"]) == timing.median_ms and int(row["reps"]) == timing.reps


def test_summary_reports_both_roles_at_the_smallest_and_largest_batch(measured):
    _, summary = measured
    assert {(p.model, p.batch_size, p.new_tokens) for p in summary.passes} == \
        {(m, b, n) for m, n in (("target", 1), ("target", 3), ("draft", 1)) for b in (1, 2)}
    assert [a.setting for a in summary.acceptance] == ["greedy", "T=1"]
    assert json.loads(json.dumps(summary.to_json()))["profile_path"].endswith("profile.json")


def test_an_infeasible_point_is_a_valid_row(tmp_path, measured):
    profile = load_profile(measured[0])
    row = timing_row(TimingPoint("target", 64, 3, 16), None)
    path = tmp_path / "profile.json"
    write_profile(path, with_row(profile, row))
    assert load_profile(path).timings[-1] == row and not row.feasible and row.median_ms is None


# ---------------------------------------------------------------- interrupt and resume
class StopAfter:
    """A progress callback that interrupts the run (as Ctrl-C would) once `n` points are saved."""

    def __init__(self, n: int):
        self.n, self.labels = n, []

    def __call__(self, event):
        self.labels.append(event.label)
        if event.done == self.n:
            raise KeyboardInterrupt


def test_the_second_stage_is_timed_where_the_runtime_guesses(pair, tmp_path, monkeypatch):
    """Where tree bookkeeping stays off the host (CUDA's record; here the CPU's tuned so), the runtime guesses
    with batched device queries, and calibration times those, not host look-ups."""
    from specbatch.calibrate import stage2 as stage2_module
    from torch_fixtures import tune_cpu

    devices, real = [], stage2_module.measure_stage2

    def spy(*args, **kwargs):
        devices.append(args[6] if len(args) > 6 else kwargs.get("device"))
        return real(*args, **kwargs)

    monkeypatch.setattr(stage2_module, "measure_stage2", spy)
    tune_cpu(monkeypatch, host_bookkeeping_max_cells=0)
    with pytest.raises(KeyboardInterrupt):
        calibrate(request(pair, tmp_path / "p.json", stage2=pair / "ngram.safetensors"), on_progress=StopAfter(2))
    assert [str(device) for device in devices] == ["cpu"]
    assert load_profile(tmp_path / "p.json").stage2.query_ms_per_context >= 0


def test_an_interrupted_run_resumes_with_only_the_rest(pair, tmp_path):
    out = tmp_path / "profile.json"
    with pytest.raises(KeyboardInterrupt):
        calibrate(request(pair, out, stage2=pair / "ngram.safetensors"), on_progress=StopAfter(6))
    partial = load_profile(out)
    assert len(partial.acceptance) + 1 + len(partial.timings) + len(partial.overheads) == 6  # nothing lost
    assert partial.stage2 is not None

    resumed = StopAfter(n=-1)
    summary = calibrate(request(pair, out, resume=True, stage2=pair / "ngram.safetensors"), on_progress=resumed)
    complete = load_profile(out)
    total = 1 + 1 + TIMINGS + 6 + TREE_ROWS + INSITU
    assert len(resumed.labels) == total - 6 and summary.points_resumed == 6
    assert complete.timings[:4] == partial.timings and complete.stage2 == partial.stage2  # measured once
    assert len(complete.timings) == TIMINGS and len(complete.overheads) == 6 + TREE_ROWS
    assert len(complete.acceptance) == 1
    labels = [f"{r.model} b={r.batch_size} n={r.new_tokens} L={r.context_len}" for r in partial.timings]
    assert not set(labels) & set(resumed.labels)


def test_resume_extends_a_profile_of_before_trees(pair, measured, tmp_path):
    """An older profile: no wide passes in its grid, no rank acceptance, no tree rows, no stage2. Resuming
    measures acceptance again (now with ranks), then only the missing points; its chain rows stay."""
    old = json.loads(measured[0].read_text())
    old["grid"]["target_new_tokens"], old["grid"]["draft_new_tokens"] = [1, 2, 3], [1, 2]
    old["timings"] = [r for r in old["timings"] if r["new_tokens"] <= (3 if r["model"] == "target" else 2)]
    old["overheads"] = [{k: v for k, v in r.items() if k not in ("tree_nodes", "stage2")}
                        for r in old["overheads"] if r["tree_nodes"] is None]
    old["acceptance"] = [{k: v for k, v in e.items() if k != "rank_acceptance"} for e in old["acceptance"]][:1]
    del old["stage2"], old["insitu_timings"], old["insitu_steps"]
    out = tmp_path / "profile.json"
    out.write_text(json.dumps(old))
    before = load_profile(out)
    labels = StopAfter(n=-1)
    summary = calibrate(request(pair, out, resume=True), on_progress=labels)
    after = load_profile(out)
    wide = TIMINGS - 2 * (3 + 2)
    assert summary.points_measured == 1 + wide + TREE_ROWS // 2 + INSITU  # no --stage2 now: trees without it only
    assert labels.labels[0] == "acceptance greedy" and after.acceptance[0].rank_acceptance is not None
    assert after.acceptance[0].per_position == before.acceptance[0].per_position  # the same measurement
    assert after.timings[:len(before.timings)] == before.timings and after.stage2 is None
    assert after.overheads[:len(before.overheads)] == before.overheads
    assert after.grid.target_new_tokens == (1, 2, 3, 16, 32, 64)
    assert {(r.batch_size, r.k) for r in after.insitu_steps} == INSITU_CELLS


def test_in_situ_rows_are_the_passes_of_real_steps(measured):
    profile = load_profile(measured[0])
    assert sorted((r.batch_size, r.k, r.sweep) for r in profile.insitu_steps) == \
        sorted((b, k, sweep) for b, k in INSITU_CELLS for sweep in (1, 2))
    for b, k in INSITU_CELLS:
        steps = [r for r in profile.insitu_steps if (r.batch_size, r.k) == (b, k)]
        passes = [r for r in profile.insitu_timings if (r.batch_size, r.k) == (b, k)]
        assert all(1.0 <= r.tokens_per_step <= k + 1 and r.p10_ms <= r.median_ms <= r.p90_ms for r in steps)
        assert all(r.in_situ and r.p10_ms <= r.median_ms <= r.p90_ms for r in passes)
        # per full-batch step: one verify pass of k + 1 tokens, and k draft passes (the first of 1 or 2 tokens)
        assert {(r.model, r.new_tokens) for r in passes if r.model == "target"} == {("target", k + 1)}
        assert sum(r.reps for r in passes if r.model == "target") == sum(r.reps for r in steps)
        draft = [r for r in passes if r.model == "draft"]
        assert sum(r.reps for r in draft) == k * sum(r.reps for r in steps)
        assert all(r.new_tokens in (1, 2) for r in draft) and (k > 0) == bool(draft)
        # what the step paid for: the prompt (at least its last token) and the tokens generated so far
        assert all(0 < r.context_len < 160 for r in passes + steps)


def test_an_interrupted_in_situ_stage_keeps_its_points(pair, tmp_path):
    class StopAtSecondInSitu:
        def __init__(self):
            self.labels = []

        def __call__(self, event):
            self.labels.append(event.label)
            if sum(label.startswith("in-situ") for label in self.labels) == 2:
                raise KeyboardInterrupt

    out = tmp_path / "profile.json"
    with pytest.raises(KeyboardInterrupt):
        calibrate(request(pair, out), on_progress=StopAtSecondInSitu())
    partial = load_profile(out)
    assert {(r.batch_size, r.k, r.sweep) for r in partial.insitu_steps} == {(1, 0, 1), (1, 2, 1)}  # both on disk
    resumed = StopAfter(n=-1)
    calibrate(request(pair, out, resume=True), on_progress=resumed)
    complete = load_profile(out)
    assert [label for label in resumed.labels if label.startswith("in-situ")] == \
        ["in-situ b=2 k=0 sweep 1", "in-situ b=2 k=2 sweep 1"] + \
        [f"in-situ b={b} k={k} sweep 2" for b, k in sorted(INSITU_CELLS)]
    assert complete.insitu_steps[:len(partial.insitu_steps)] == partial.insitu_steps
    assert len({(r.batch_size, r.k, r.sweep) for r in complete.insitu_steps}) == INSITU
    assert complete.insitu_timings[:len(partial.insitu_timings)] == partial.insitu_timings


def test_resume_refuses_another_second_stage(pair, measured, tmp_path):
    out = tmp_path / "profile.json"
    shutil.copy(measured[0], out)
    other = tmp_path / "other.safetensors"
    sequences = np.random.default_rng(1).integers(0, 259, size=(5, 50))
    NGramModel.fit(sequences, 259, tokenizer_fingerprint(pair / "target" / "tokenizer.json")).save(other)
    with pytest.raises(CalibrationError, match=r"--resume: .* measured the second stage with .*ngram.safetensors "
                                               r"\(sha256 [0-9a-f]{12}\), not --stage2 .*other.safetensors"):
        calibrate(request(pair, out, resume=True, stage2=other))


def test_resume_refuses_a_profile_of_another_pair_or_dtype(pair, measured, tmp_path):
    out = tmp_path / "profile.json"
    shutil.copy(measured[0], out)
    with pytest.raises(CalibrationError,
                       match=r"different draft \(config or weights differ: .*; layers 1 there, 2 now"):
        calibrate(request(pair, out, draft=str(pair / "target"), resume=True))
    with pytest.raises(CalibrationError, match="different device .*dtype 'float32' there, 'bfloat16' now"):
        calibrate(request(pair, out, dtype="bfloat16", resume=True))


def test_random_weights_take_the_given_acceptance(pair, tmp_path):
    config = tmp_path / "config.json"
    shutil.copy(pair / "target" / "config.json", config)
    out = tmp_path / "profile.json"
    calibrate(request(pair, out, target=str(config), draft=str(config), acceptance="0.9,0.8", batch_sizes=(1,),
                      max_k=3))
    profile = load_profile(out)
    assert profile.target.random_weights and profile.draft.random_weights
    [entry] = profile.acceptance
    assert (entry.source, entry.per_position, entry.trials) == ("user", (0.9, 0.8, 0.8), None)
    assert entry.rank_acceptance is None and not any(r.tree_nodes for r in profile.overheads)  # no tree to grow


def test_random_weights_time_steps_in_situ_at_the_given_acceptance(pair, tmp_path):
    """Random weights never agree by themselves; the in-situ steps accept at the given acceptance, so at
    1.0 every chain step of k = 2 keeps k + 1 tokens per row (the last, cut at max new tokens, fewer),
    no speculation keeps one, and fit can check the step model against these steps."""
    from specbatch.perfmodel.fit import fit_profile

    config = tmp_path / "config.json"
    shutil.copy(pair / "target" / "config.json", config)
    out = tmp_path / "profile.json"
    calibrate(request(pair, out, target=str(config), draft=str(config), acceptance="1.0", prompts=None))
    profile = load_profile(out)
    steps = {(s.batch_size, s.k, s.sweep): s for s in profile.insitu_steps}
    assert set(steps) == {(b, k, sweep) for b, k in INSITU_CELLS for sweep in (1, 2)}
    for (b, k, sweep), step in steps.items():
        assert step.tokens_per_step == 1.0 if k == 0 else 2.5 < step.tokens_per_step <= 3.0
    fitted = fit_profile(profile)
    assert fitted.timing_source is not None and len(fitted.timing_source.reports) == 3  # isolated, in-situ, both


def test_second_stage_errors_name_the_option_and_the_file(pair, tmp_path):
    out = tmp_path / "profile.json"
    cases = [(pair / "missing.safetensors", "--stage2: .*missing.safetensors: no such n-gram file"),
             (pair / "small-vocab.safetensors", "--stage2 .*small-vocab.safetensors: a vocabulary of 100 tokens, "
                                                "the target's has 259"),
             (pair / "other-tokenizer.safetensors", "--stage2 .*other-tokenizer.safetensors: n-gram file was fitted "
                                                    "for tokenizer 000000000000"),
             (pair / "prompts.jsonl", "--stage2: .*prompts.jsonl: not a readable safetensors file")]
    for path, message in cases:
        with pytest.raises(SpecbatchError, match=message) as error:  # runtime.loading.load_ngram's checks
            calibrate(request(pair, out, stage2=path))
        assert "\n" not in str(error.value)
    with pytest.raises(CalibrationError, match="--stage2 .*ngram.safetensors: .* --acceptance"):
        calibrate(request(pair, out, stage2=pair / "ngram.safetensors", acceptance="0.8"))
    assert not out.exists()  # refused before anything was written


def test_default_second_stage_is_the_bundled_ngram_for_the_bundled_draft(pair):
    assert default_stage2(str(DEMO_DRAFT)) == DEMO_NGRAM and DEMO_NGRAM.is_file()
    assert default_stage2(str(DEMO_DRAFT), acceptance="0.8") is None  # no measured acceptance: nothing to guess
    assert default_stage2(str(pair / "draft")) is None and default_stage2("llama-68m") is None


def test_the_default_run_measures_trees_above_its_max_k():
    # a grown tree of at most max_k nodes may be a plain chain, whose steps take the chain code path
    assert min(DEFAULT_EFFORT.tree_nodes) > 8 and min(QUICK_EFFORT.tree_nodes) > 8


def test_new_profile_for_an_empty_grid_point_list_is_writable(tmp_path, measured):
    old = load_profile(measured[0])
    fresh = new_profile(old.device, old.target, old.draft, old.grid)
    write_profile(tmp_path / "p.json", fresh)
    assert load_profile(tmp_path / "p.json").timings == ()


# ---------------------------------------------------------------- the CLI
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(cli.app, ["calibrate", *args])


def test_cli_json_prints_one_object(pair, tmp_path):
    out = tmp_path / "p.json"
    result = invoke("--target", str(pair / "target"), "--draft", str(pair / "draft"), "--prompts",
                    str(pair / "prompts.jsonl"), "--batch-sizes", "1", "--context-lens", "8", "--max-k", "1",
                    "--quick", "--json", "--out", str(out), "--device", "cpu")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    timings = (2 + 3) + (2 + 5)  # b = 1, max_k = 1: target n = 1, 2 and 16, 32, 64; draft n = 1, 2 and 4..64
    trees = len(QUICK_EFFORT.tree_nodes)  # no second stage: the bundled n-gram is the bundled draft's only
    insitu = QUICK_EFFORT.insitu_sweeps  # b = 1, k = 0 (the quick k up to max_k), once per sweep
    assert summary["profile_path"] == str(out) and summary["points_measured"] == 1 + timings + 2 + trees + insitu


@pytest.fixture
def bad_input_files(pair, measured, tmp_path):
    incomplete = tmp_path / "incomplete.json"
    incomplete.write_text(json.dumps({"model_type": "llama", "vocab_size": 259, "hidden_size": 32}))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    other_device = tmp_path / "other-device.json"
    profile = json.loads(measured[0].read_text())
    profile["device"]["name"] = "Some Other CPU"
    other_device.write_text(json.dumps(profile))
    other_pair = tmp_path / "other-pair.json"
    shutil.copy(measured[0], other_pair)
    return {"pair": pair, "incomplete": incomplete, "empty": empty, "other_device": other_device,
            "other_pair": other_pair}


BAD_INPUTS = [
    ("unknown preset", ["--target", "llama-7b", "--acceptance", "0.8"], "not a preset (presets: opt-125m"),
    ("config without fields", ["--target", "{incomplete}", "--acceptance", "0.8"],
     "missing field(s) num_hidden_layers, num_attention_heads, intermediate_size, max_position_embeddings"),
    ("zero batch size", ["--batch-sizes", "1,0"], "--batch-sizes: '0' is not a positive integer"),
    ("text batch size", ["--batch-sizes", "1,two"], "--batch-sizes: 'two' is not a positive integer"),
    ("negative context", ["--context-lens", "-8"], "--context-lens: '-8' is not a positive integer"),
    ("context beyond positions", ["--target", "gpt2", "--draft", "gpt2", "--acceptance", "0.8",
                                  "--context-lens", "1020", "--max-k", "8"],
     "1029 positions exceeds the target's maximum of 1024"),
    ("resume other pair", ["--draft", "{pair}/target", "--resume", "--out", "{other_pair}"],
     "is for a different draft (config or weights differ"),
    ("resume other device", ["--resume", "--out", "{other_device}"],
     "was measured on a different device (name 'Some Other CPU' there"),
    ("empty prompts", ["--prompts", "{empty}"], "the file holds no prompts"),
    ("preset without acceptance", ["--target", "opt-125m", "--draft", "opt-125m"],
     "--target opt-125m and --draft opt-125m: random weights"),
    ("bad sampling", ["--sampling", "T=hot"], "--sampling 'T=hot'"),
    ("bad acceptance", ["--acceptance", "1.5"], "--acceptance: acceptance 1.5 is outside (0, 1]"),
    ("bad device", ["--device", "tpu"], "--device: 'tpu' is not one of cpu, cuda"),
    ("different vocabularies", ["--target", "gpt2", "--draft", "llama-68m", "--acceptance", "0.8"],
     "--draft llama-68m: a vocabulary of 32000 tokens, the target's has 50257; draft and target must share"),
    ("too large for memory", ["--target", "llama-2-7b", "--draft", "llama-68m", "--acceptance", "0.8",
                              "--dtype", "bfloat16", "--batch-sizes", "100000", "--context-lens", "2000"],
     "no target pass of the grid fits on cpu"),
]


@pytest.mark.parametrize("name, args, message", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_one_line_with_exit_code_2(bad_input_files, tmp_path, name, args, message):
    files = bad_input_files
    defaults = ["--target", str(files["pair"] / "target"), "--draft", str(files["pair"] / "draft"),
                "--prompts", str(files["pair"] / "prompts.jsonl"), "--out", str(tmp_path / "p.json"),
                "--device", "cpu", "--batch-sizes", "1", "--context-lens", "8", "--max-k", "1", "--quick"]
    result = invoke(*defaults, *[arg.format(**files) for arg in args])  # later options override earlier ones
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert message in lines[0]
