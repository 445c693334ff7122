"""`specbatch fit | table | query | plot` end to end on synthetic profiles, and every bad input."""
from __future__ import annotations

import json

import pytest

from specbatch.perfmodel.model import load_model
from specbatch.perfmodel.table import load_table
from cli_helpers import assert_one_line_error, invoke
from perfmodel_fixtures import build_profile, roofline_latency, write_profile

SMALL = dict(batch_sizes=(1, 2, 4, 8, 16), context_lens=(128, 512, 2048), max_k=4)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A profile with acceptance, one without, and the model fitted from each (fitted once)."""
    root = tmp_path_factory.mktemp("perfmodel_cli")
    paths = {"profile": write_profile(root / "profile.json",
                                      build_profile(roofline_latency(), acceptance=[0.8, 0.75], **SMALL)),
             "bare_profile": write_profile(root / "bare.json",
                                           build_profile(roofline_latency(), acceptance=None, **SMALL))}
    for name, profile in (("model", "profile"), ("bare_model", "bare_profile")):
        paths[name] = root / f"{name}.json"
        result = invoke("fit", paths[profile], "-o", paths[name])
        assert result.exit_code == 0, result.output
    paths["root"] = root
    return paths


def test_fit_json_prints_one_object(files, tmp_path):
    out = tmp_path / "model.json"
    result = invoke("fit", files["profile"], "-o", out, "--holdout", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # the whole of stdout is one JSON object
    target = report["roles"]["target"]
    assert target["kind"] in ("roofline", "roofline+monotone")
    assert set(target["roofline"]) == {"overhead_ms", "bandwidth_GBps", "flops_TFLOPs", "overlap_exponent",
                                       "ridge_tokens"}
    assert target["validation"]["holdout"]["held_out_batch_sizes"] == [2, 8]
    assert target["validation"]["holdout"]["mape_pct"] < 5.0
    assert load_model(out).roles["draft"].holdout is not None


def test_fit_human_report(files, tmp_path):
    result = invoke("fit", files["profile"], "-o", tmp_path / "m.json", "--holdout")
    assert result.exit_code == 0, result.output
    for text in ("bandwidth_GBps", "flops_TFLOPs", "overhead_ms", "held-out MAPE", "worst held-out points"):
        assert text in result.stdout


def test_model_file_round_trips_predictions(files):
    model = load_model(files["model"])
    again = files["root"] / "again.json"
    from specbatch.perfmodel.model import save_model

    save_model(again, model)
    reloaded = load_model(again)
    for role in ("target", "draft"):
        assert reloaded.latency_ms(role, 3, 2, 700) == pytest.approx(model.latency_ms(role, 3, 2, 700), rel=1e-6)


def test_table_json_and_exports(files, tmp_path):
    out = tmp_path / "table.json"
    result = invoke("table", files["model"], "-o", out, "--max-batch", "16")
    assert result.exit_code == 0, result.output
    table = load_table(out)
    # by default the profiled 128..2048 in steps of at most sqrt(2) (hand-computed: 128 * 2 ** (i / 2))
    contexts = [128, 181, 256, 362, 512, 724, 1024, 1448, 2048]
    assert [b.context_len for b in table.buckets] == contexts
    assert all([e.batch_size for e in b.entries] == list(range(1, 17)) for b in table.buckets)
    header = next(line for line in result.stdout.splitlines() if " b " in line and "2048" in line)
    assert [int(cell) for cell in header.replace("┃", " ").split()[1:]] == contexts  # one column per bucket
    ks = [e.k for e in table.bucket_for(512).entries]  # the middle of the profiled 128, 512, 2048

    result = invoke("table", files["model"], "-o", tmp_path / "t.csv", "--max-batch", "16", "--format", "csv")
    lines = (tmp_path / "t.csv").read_text().splitlines()
    assert lines[0] == "batch_size,k,predicted_tokens_per_s,predicted_speedup,context_len,strategy"
    assert len(lines) == 1 + 16 * len(contexts)
    assert [int(line.split(",")[1]) for line in lines[1:] if line.split(",")[4] == "512"] == ks

    result = invoke("table", files["model"], "-o", tmp_path / "one.json", "--max-batch", "16", "--context-lens", "512")
    assert result.exit_code == 0, result.output
    assert "k*" in result.stdout and "speedup vs k=0" in result.stdout  # one bucket: the detailed view
    assert [e.k for e in load_table(tmp_path / "one.json").buckets[0].entries] == ks

    draft = tmp_path / "draft"  # the synthetic profile's draft is no directory: name one
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    result = invoke("table", files["model"], "-o", tmp_path / "v.json", "--max-batch", "16", "--format", "vllm",
                    "--draft", draft)
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "v.json").read_text())
    assert config["method"] == "draft_model" and config["model"] == str(draft.resolve())
    ranges = config["num_speculative_tokens_per_batch_size"]
    assert [k for start, end, k in ranges for _ in range(start, end + 1)] == ks

    assert max(ks) > ks[0]  # this model's k rises from b=1 to b=2: TensorRT-LLM cannot take it as it is
    assert_one_line_error(invoke("table", files["model"], "-o", tmp_path / "r.json", "--max-batch", "16",
                                 "--format", "trtllm", "--draft", draft), "k rises above", "--clamp")
    result = invoke("table", files["model"], "-o", tmp_path / "r.json", "--max-batch", "16", "--format", "trtllm",
                    "--draft", draft, "--clamp")
    assert result.exit_code == 0, result.output
    assert f"k capped at {ks[0]}" in " ".join(result.stdout.split())  # rich wraps long lines
    config = json.loads((tmp_path / "r.json").read_text())
    schedule = {int(b): k for b, k in config["draft_len_schedule"].items()}  # key: the last batch size of a run
    assert [schedule[min(key for key in schedule if key >= b)] if b <= max(schedule) else 0
            for b in range(1, 17)] == [min(k, ks[0]) for k in ks]
    assert config["max_draft_len"] == ks[0]


def test_table_with_context_buckets_and_what_if_acceptance(files, tmp_path):
    out = tmp_path / "table.json"
    result = invoke("table", files["bare_model"], "-o", out, "--max-batch", "8", "--context-lens", "128,4096",
                    "--acceptance", "0.9,0.8")
    assert result.exit_code == 0, result.output
    table = load_table(out)
    assert [b.context_len for b in table.buckets] == [128, 4096]
    assert table.acceptance["source"] == "user" and table.acceptance["per_position"] == [0.9, 0.8]
    assert "outside the profiled" in result.stdout  # 4096 > 2048 is extrapolated, and the report says so


def test_query_json(files):
    result = invoke("query", files["model"], "--batch-size", "4", "--context-len", "512", "--strategies", "chain",
                    "--json")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert set(answer) == {"batch_size", "context_len", "best_k", "candidates"}
    assert [c["k"] for c in answer["candidates"]] == list(range(5))
    assert set(answer["candidates"][0]) == {"k", "step_ms", "tokens_per_step", "tokens_per_s"}
    best = max(answer["candidates"], key=lambda c: c["tokens_per_s"])
    assert answer["best_k"] == best["k"]
    assert answer["candidates"][0]["tokens_per_step"] == 1.0


def test_query_a_table_gives_the_tables_choice(files, tmp_path):
    out = tmp_path / "table.json"
    invoke("table", files["model"], "-o", out, "--max-batch", "8")
    result = invoke("query", "--table", out, "--batch-size", "3", "--context-len", "512", "--json")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["best_k"] == load_table(out).lookup(3, 512)
    [candidate] = answer["candidates"]
    direct = json.loads(invoke("query", files["model"], "--batch-size", "3", "--context-len", "512",
                               "--strategies", "chain", "--json").stdout)
    same = direct["candidates"][candidate["k"]]
    assert candidate["tokens_per_s"] == pytest.approx(same["tokens_per_s"], rel=1e-5)
    assert candidate["step_ms"] == pytest.approx(same["step_ms"], rel=1e-5)
    # no --context-len: the middle of the table's nine buckets (128 ... 2048), 512, the profile's middle too
    plain = json.loads(invoke("query", "--table", out, "--batch-size", "3", "--json").stdout)
    assert plain["context_len"] == 512 and plain["candidates"] == answer["candidates"]


def test_plot_writes_an_image(files, tmp_path):
    out = tmp_path / "fig.png"
    result = invoke("plot", files["model"], "-o", out, "--max-batch", "16")
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_curve_is_the_tables_choice_with_measured_tokens_per_step(files):
    """The heatmap's k*(b) is the table's, also when the acceptance carries measured E(k)."""
    import dataclasses

    from specbatch.perfmodel.model import choose_acceptance, compute_table
    from specbatch.perfmodel.plot import goodput_grid

    fitted = load_model(files["model"])
    base = choose_acceptance(fitted, None)
    flat_tokens = (1.0, 1.5, 1.6, 1.65, 1.66, 1.67, 1.68, 1.69, 1.7)[:fitted.grid.max_k + 1]
    flat = dataclasses.replace(base, tokens_per_step=flat_tokens)
    for acceptance in (base, flat):
        table = compute_table(fitted, acceptance, 16, [128])
        _, best = goodput_grid(fitted, acceptance, 16, 128, table.max_k)
        assert list(best) == [entry.k for entry in table.buckets[0].entries]


# ---------------------------------------------------------------- bad input: exit code 2, one line

def test_wrong_schema_profile(files, tmp_path):
    assert_one_line_error(invoke("fit", files["model"], "-o", tmp_path / "m.json"),
                          "schema 'specbatch.model/1', expected 'specbatch.profile/1'")


def test_wrong_schema_model(files, tmp_path):
    assert_one_line_error(invoke("table", files["profile"], "-o", tmp_path / "t.json"),
                          "schema 'specbatch.profile/1', expected 'specbatch.model/1'")
    assert_one_line_error(invoke("query", "--table", files["model"], "--batch-size", "1"),
                          "expected 'specbatch.table/1'")


def test_no_acceptance_and_no_option(files, tmp_path):
    assert_one_line_error(invoke("table", files["bare_model"], "-o", tmp_path / "t.json"),
                          "no acceptance measurements", "--acceptance")
    assert_one_line_error(invoke("query", files["bare_model"], "--batch-size", "2"), "--acceptance")


@pytest.mark.parametrize("value", ["1.5", "0", "0.9,-0.1"])
def test_acceptance_outside_open_unit_interval(files, tmp_path, value):
    assert_one_line_error(invoke("table", files["model"], "-o", tmp_path / "t.json", "--acceptance", value),
                          "--acceptance", "outside (0, 1]")


def test_too_few_points_for_a_role(tmp_path):
    profile = write_profile(tmp_path / "p.json", build_profile(roofline_latency(), batch_sizes=(1, 2),
                                                               context_lens=(128,),
                                                               max_k=4, acceptance=[0.8]))
    assert_one_line_error(invoke("fit", profile, "-o", tmp_path / "m.json"), "draft", "at least 8", "has 4")


@pytest.mark.parametrize("value", ["0", "-3"])
def test_non_positive_batch_size(files, value):
    assert_one_line_error(invoke("query", files["model"], "--batch-size", value), "--batch-size must be >= 1")


@pytest.mark.parametrize("command", ["table", "query", "plot"])
def test_max_k_is_bounded_where_more_draft_tokens_cannot_pay(files, tmp_path, command):
    """--max-k 1000 ran for many minutes without a line; past MAX_TABLE_K it is refused at once, saying why."""
    from specbatch.perfmodel.table import MAX_TABLE_K

    where = ["--batch-size", "1"] if command == "query" else ["-o", tmp_path / "out.png"]
    result = invoke(command, files["model"], *where, "--max-k", MAX_TABLE_K + 1)
    assert_one_line_error(result, f"--max-k must be in [0, {MAX_TABLE_K}], found {MAX_TABLE_K + 1}", "acceptance 0.9")
    assert not (tmp_path / "out.png").exists()
    if command == "query":  # the bound itself is a value the commands take
        assert invoke("query", files["model"], "--batch-size", "1", "--max-k", MAX_TABLE_K).exit_code == 0


def test_a_directory_given_for_a_file_is_named_as_one(tmp_path):
    """`fit DIR` said "no such file" of a folder that exists."""
    assert_one_line_error(invoke("fit", tmp_path, "-o", tmp_path / "m.json"),
                          f"{tmp_path}: a directory, expected a specbatch.profile/1 JSON file")
    assert_one_line_error(invoke("table", tmp_path, "-o", tmp_path / "t.json"),
                          f"{tmp_path}: a directory, expected a specbatch.model/1 JSON file")


def test_query_needs_exactly_one_source(files):
    assert_one_line_error(invoke("query", "--batch-size", "2"), "either a model file or --table")
    assert_one_line_error(invoke("query", files["model"], "--table", files["model"], "--batch-size", "2"),
                          "either a model file or --table")


def test_other_bad_options(files, tmp_path):
    assert_one_line_error(invoke("table", files["model"], "-o", tmp_path / "t", "--format", "xml"), "--format")
    assert_one_line_error(invoke("table", files["model"], "-o", tmp_path / "t", "--max-batch", "0"), "--max-batch")
    assert_one_line_error(invoke("table", files["model"], "-o", tmp_path / "t", "--context-lens", "512,x"),
                          "--context-lens")
    assert_one_line_error(invoke("table", files["model"], "-o", tmp_path / "t.json", "--context-lens", "128,512",
                                 "--format", "vllm"), "--format vllm", "single --context-lens")
    assert_one_line_error(invoke("fit", tmp_path / "missing.json", "-o", tmp_path / "m.json"), "no such file")
    assert_one_line_error(invoke("table", files["model"], "-o", tmp_path / "t.json", "--format", "vllm"),
                          "--format vllm: the table's draft 'synthetic' is not a model directory", "--draft DIR")
    assert_one_line_error(invoke("table", files["model"], "-o", tmp_path / "t.json", "--clamp"), "--clamp", "trtllm")
    assert_one_line_error(invoke("table", files["model"], "-o", tmp_path / "t.csv", "--format", "csv", "--draft",
                                 tmp_path), "--draft", "vllm or trtllm")


def test_an_engine_export_ranks_the_chains_the_engine_runs_and_prints_their_prediction(tmp_path):
    """With trees and the n-gram stage winning at b = 1 (`--strategies all`, the default), the vllm export is
    the best chain's, the printed prediction is that chain's, and the same table as JSON is what
    bench --peers vllm accepts (its export is the same)."""
    from perfmodel_fixtures import tree_profile

    from specbatch.bench.vllm.compare import check_chains_only
    from specbatch.perfmodel.model import choose_acceptance, compute_table, load_model
    from specbatch.perfmodel.table import load_table, to_vllm
    from specbatch.runtime.assembly import DEMO_DRAFT

    write_profile(tmp_path / "p.json", tree_profile())
    assert invoke("fit", tmp_path / "p.json", "-o", tmp_path / "m.json").exit_code == 0
    fitted = load_model(tmp_path / "m.json")
    everything = compute_table(fitted, choose_acceptance(fitted, None), 8, [128])
    assert everything.buckets[0].entries[0].chosen().kind == "tree"  # what the export must not carry
    result = invoke("table", tmp_path / "m.json", "--format", "vllm", "--max-batch", 8, "--context-lens", 128,
                    "--draft", DEMO_DRAFT, "-o", tmp_path / "spec.json")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stdout.split())
    assert "chains only were ranked" in said and "tree" not in said.split("chains only")[0]
    chains = compute_table(fitted, choose_acceptance(fitted, None), 8, [128], strategies="chain")
    best = chains.buckets[0].entries[0]
    assert f"{best.predicted_speedup:.2f}x" in said  # the chain's prediction, not the tree's
    export = json.loads((tmp_path / "spec.json").read_text())
    assert export == to_vllm(chains, draft=DEMO_DRAFT)
    assert invoke("table", tmp_path / "m.json", "--strategies", "chain", "--max-batch", 8, "--context-lens", 128,
                  "-o", tmp_path / "t.json").exit_code == 0
    for_bench = load_table(tmp_path / "t.json")
    check_chains_only(for_bench, "t.json")  # bench --peers vllm takes it
    assert to_vllm(for_bench, draft=DEMO_DRAFT) == export


# ------------------------------------------------------------------------------ a profile cut short
def _cut_short(tmp_path):
    """A grid of b = 1..16 whose calibration stopped before the target's b = 16 passes and half the overheads."""
    profile = build_profile(roofline_latency(), batch_sizes=(1, 2, 4, 8, 16), context_lens=(64, 256), max_k=3,
                            acceptance=[0.6])
    full = len(profile["timings"])
    profile["timings"] = [row for row in profile["timings"] if not (row["model"] == "target" and
                                                                    row["batch_size"] == 16)]
    profile["stopped_early"] = "--max-seconds 30"
    write_profile(tmp_path / "p.json", profile)
    return full, full - len(profile["timings"])


def test_fit_and_table_say_what_a_cut_short_profile_misses_and_table_refuses_to_extrapolate(tmp_path):
    full, missing = _cut_short(tmp_path)
    result = invoke("fit", tmp_path / "p.json", "-o", tmp_path / "m.json")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stdout.split())
    assert f"{full - missing} of {full} planned pass timings" in said
    assert "calibrate stopped by --max-seconds 30" in said
    assert "no timing at all for target b=16 L=64, target b=16 L=256" in said
    result = invoke("table", tmp_path / "m.json", "--max-batch", 12, "-o", tmp_path / "t.json")
    assert_one_line_error(result, f"{tmp_path / 'm.json'}: the profile is incomplete", "target b=16 L=64",
                          "--force")
    assert not (tmp_path / "t.json").exists()
    result = invoke("table", tmp_path / "m.json", "--max-batch", 12, "-o", tmp_path / "t.json", "--force")
    assert result.exit_code == 0 and "the profile is incomplete" in " ".join(result.stdout.split())
    result = invoke("table", tmp_path / "m.json", "--max-batch", 8, "-o", tmp_path / "t8.json")
    assert result.exit_code == 0, result.output  # b = 1..8 rests on measured cells only; the gap is still said
    assert "the profile is incomplete" in " ".join(result.stdout.split())


def test_a_profile_that_ran_its_plan_has_no_coverage_note(tmp_path):
    profile = build_profile(roofline_latency(), batch_sizes=(1, 2, 4), context_lens=(64, 256), max_k=3,
                            acceptance=[0.6])
    write_profile(tmp_path / "p.json", profile)
    result = invoke("fit", tmp_path / "p.json", "-o", tmp_path / "m.json", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["coverage"] is None


# ------------------------------------------------------------------------------ heads and SGLang
def test_table_exports_the_drafter_the_table_records_to_every_engine(files, tmp_path, monkeypatch):
    """The export's method, decoding config and SGLang algorithm come from Table.drafter; --draft names the
    head's directory. (The fixture's model is a draft model's: the table it gives is made a head's here.)"""
    import dataclasses

    from specbatch.perfmodel import model as model_module
    from specbatch.perfmodel.table import to_sglang, to_trtllm, to_vllm

    computed = model_module.compute_table
    tables = []

    def as_eagle3(*args, **kwargs):
        tables.append(dataclasses.replace(computed(*args, **kwargs), drafter="eagle3"))
        return tables[-1]

    monkeypatch.setattr(model_module, "compute_table", as_eagle3)
    head = tmp_path / "eagle3-head"
    head.mkdir()
    (head / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000}')
    common = ("--max-batch", "16", "--context-lens", "512", "--draft", head)
    for fmt, export, extra in (("vllm", to_vllm, ()), ("trtllm", to_trtllm, ("--clamp",)), ("sglang", to_sglang, ())):
        out = tmp_path / f"{fmt}.json"
        result = invoke("table", files["model"], "-o", out, "--format", fmt, *common, *extra)
        assert result.exit_code == 0, result.output
        kwargs = {"clamp": True} if fmt == "trtllm" else {"config_path": out} if fmt == "sglang" else {}
        assert json.loads(out.read_text()) == export(tables[-1], draft=head, **kwargs)
    assert json.loads((tmp_path / "vllm.json").read_text())["method"] == "eagle3"
    assert json.loads((tmp_path / "trtllm.json").read_text())["decoding_type"] == "Eagle3"
    said = " ".join(result.stdout.split())
    assert ("sglang: serve with python -m sglang.launch_server --model-path TARGET --speculative-algorithm "
            "EAGLE3") in said

    result = invoke("table", files["model"], "-o", tmp_path / "g.json", "--format", "sglang", *common,
                    "--cuda-graph-bs", "2,16")
    k = [e.k for e in tables[-1].buckets[0].entries]
    ends = [b for b in range(1, 16) if k[b - 1] != k[b] and b not in (2, 16)]  # runs SGLang would pad past
    if ends:
        assert_one_line_error(result, "--format sglang: SGLang pads a batch to its next CUDA-graph size",
                              f"b={ends[0]} (k={k[ends[0] - 1]}) and b={ends[0] + 1} (k={k[ends[0]]})")
    else:
        assert result.exit_code == 0, result.output


def test_table_refuses_sglang_for_a_draft_model_and_its_options_elsewhere(files, tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    assert_one_line_error(invoke("table", files["model"], "-o", tmp_path / "s.json", "--format", "sglang",
                                 "--max-batch", "8", "--draft", draft),
                          "--format sglang: SGLang switches speculation steps by batch size for EAGLE/EAGLE3 heads "
                          "only", "--format vllm or trtllm")
    assert not (tmp_path / "s.json").exists()
    assert_one_line_error(invoke("table", files["model"], "-o", tmp_path / "v.json", "--format", "vllm",
                                 "--cuda-graph-bs", "1,2"), "--cuda-graph-bs applies to --format sglang only")
    assert_one_line_error(invoke("table", files["model"], "-o", tmp_path / "v.json", "--format", "sglang",
                                 "--cuda-graph-bs", "1,x"), "--cuda-graph-bs: 'x' is not a positive integer")
