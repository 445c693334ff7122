"""benchmarks/results.py's pure parts: the markdown it writes from a constructed bench.json and fit JSON, and
the README's results block, which must carry docs/results.md's own conditions line and table."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("results_script", ROOT / "benchmarks" / "results.py")
results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results)


def policy(name: str, **fields) -> dict:
    return {"policy": name, "k": fields.pop("k", None), **fields}


def bench_document() -> dict:
    return {"schema": "specbatch.bench/1", "batch_sizes": [
        {"batch_size": 1, "table_speedup": 1.8123, "policies": [
            policy("k=0", k=0), policy("k=4", k=4),
            policy("table", k=4, strategy="chain k=4 +ngram", prediction_error=0.0312)],
         "paired_regret": {"against": "k=4", "rounds": 7, "regret": -0.0123, "ci95": [-0.031, 0.0049],
                           "verdict": "met", "settled": True}},
        {"batch_size": 32, "table_speedup": 1.25, "policies": [
            policy("k=0", k=0), policy("table", k=2, prediction_error=None)],
         "paired_regret": None},
        {"batch_size": 2, "table_speedup": None, "policies": [
            policy("k=0", k=0), policy("table", k=3, strategy="tree 0,1,0.0 (3 nodes) +ngram", prediction_error=-0.2)],
         "paired_regret": None},
    ]}


def test_the_results_table_has_one_row_per_batch_size_with_the_figures_rounded_as_printed():
    table = results.results_table(results.results_rows(bench_document()))
    assert table.splitlines() == [
        "| b | table's strategy | speedup over k = 0 | regret [95 % interval] | prediction error |",
        "|---:|---|---:|---|---:|",
        "| 1 | chain k=4 +ngram | 1.81x | -1.2 % [-3.1, 0.5] | +3.1 % |",
        "| 32 | k=2 | 1.25x | - | - |",  # no strategy recorded: the k; no paired regret, no prediction
        "| 2 | tree of 3 nodes +ngram | - | - | -20.0 % |",  # a tree by its size
    ]
    assert results.regret_details(results.results_rows(bench_document())) == (
        "- b = 1: against k=4 over 7 paired rounds: met.")


def test_a_bench_file_of_another_schema_or_without_the_table_is_refused_in_one_line():
    with pytest.raises(results.ResultsError, match="schema 'specbatch.profile/1'"):
        results.results_rows({"schema": "specbatch.profile/1", "batch_sizes": []})
    document = bench_document()
    document["batch_sizes"][0]["policies"] = [policy("k=0", k=0)]
    with pytest.raises(results.ResultsError, match="batch size 1 has no table policy"):
        results.results_rows(document)


def fit_document(nested: bool) -> dict:
    source = {"chosen": "isolated+in-situ", "criterion": "held-out step MAPE", "sources": [
        {"source": "isolated", "heldout_step_mape_pct": 12.34}, {"source": "in-situ", "heldout_step_mape_pct": None},
        {"source": "isolated+in-situ", "heldout_step_mape_pct": 9.87}]}
    correction = {"applied": True, "heldout_error_pct": 2.314, "heldout_uncorrected_pct": 2.987}
    roles = {"target": {"kind": "roofline", "validation": {
        "in_sample_mape_pct": 4.26, "holdout": {"held_out_batch_sizes": [2, 8], "held_out_context_lens": [256],
                                                "test_points": 20, "mape_pct": 7.14, "max_error_pct": 15.5}}},
             "draft": {"kind": "roofline+monotone", "validation": {"in_sample_mape_pct": 3.0, "holdout": None}}}
    if nested:
        return {"roles": roles, "step_stage": {"timing_source": source, "step_correction": correction}}
    return {"roles": roles, "timing_source": source, "step_correction": correction}


@pytest.mark.parametrize("nested", [False, True])
def test_the_fit_figures_name_each_held_out_error(nested):
    assert results._listed([48, 50, 52, 56, 58]) == "5 from 48 to 58" and results._listed([2, 8]) == "2, 8"
    noise = {"reference": "target b=1 n=1 L=128", "checks": [{}] * 12, "floor_mape": 0.0431, "drift": 0.25}
    lines = results.fit_figures(fit_document(nested), noise).splitlines()
    assert lines == [
        "| role | kind | in-sample MAPE | held out (b; L) | points | held-out MAPE | worst |",
        "|---|---|---:|---|---:|---:|---:|",
        "| target | roofline | 4.3 % | 2, 8; 256 | 20 | 7.1 % | 15.5 % |",
        "| draft | roofline+monotone | 3.0 % | - | - | - | - |",
        "",
        "- **Timing source**: isolated+in-situ (lowest held-out step MAPE); held-out step MAPE by batch size: "
        "isolated 12.3 %, isolated+in-situ 9.9 %.",
        "- **In-situ step correction**: applied; paired step error on held-out sweeps 2.99 % by the model alone, "
        "2.31 % corrected.",
        "- **Noise floor**: the reference pass (target b=1 n=1 L=128), timed 12 times during calibration, lay "
        "4.3 % from its own median on average (drift ±25.0 %): a MAPE near that is the machine's.",
    ]


def test_the_conditions_line_names_the_pair_the_machine_and_the_rounds_and_marks_a_smoke_test():
    profile = {"device": {"kind": "cpu", "name": "x86_64", "dtype": "float32", "torch_version": "2.13.0",
                          "cpu_threads": 1},
               "models": {"target": {"parameters": 4886528}, "draft": {"parameters": 474240}}}
    config = {"sampling": "greedy", "max_new_tokens": 64, "rounds": 5, "interleave": "steps"}
    assert results.conditions_line(profile, config, "AMD EPYC 7B13", 2, quick=False) == (
        "Demo pair (4.9 M-parameter target, 0.47 M draft), greedy, 64 new tokens per row, 5 rounds (in lockstep); "
        "AMD EPYC 7B13, 2 cores, torch 2.13.0, 1 thread, float32.")
    gpu = dict(profile, device=dict(profile["device"], kind="cuda", name="NVIDIA H200", dtype="bfloat16",
                                    cpu_threads=16))
    assert results.conditions_line(gpu, dict(config, interleave="runs"), "ignored", 16, quick=True) == (
        "Demo pair (4.9 M-parameter target, 0.47 M draft), greedy, 64 new tokens per row, 5 rounds (back to back); "
        "NVIDIA H200 (cuda), torch 2.13.0, 16 threads, bfloat16. "
        "**Smoke test (`--quick`): not the published figures.**")


def test_the_page_lists_each_command_with_its_duration_and_the_readme_block_is_replaced_in_place():
    page = results.render_results("Conditions.", [("specbatch fit p.json -o m.json", 2.4)], "| t |", "- d", "- f")
    assert "specbatch fit p.json -o m.json    # 2 s" in page
    assert all(f"\n{part}\n" in page for part in ("Conditions.", "| t |", "- d", "- f"))
    readme = f"intro\n{results.README_BEGIN}\nold table\n{results.README_END}\nrest\n"
    assert results.replace_block(readme, "new table") == (
        f"intro\n{results.README_BEGIN}\nnew table\n{results.README_END}\nrest\n")
    with pytest.raises(results.ResultsError, match="no <!-- results:begin -->"):
        results.replace_block("no markers", "x")


def test_the_readme_carries_the_conditions_and_table_of_docs_results_md():
    page = (ROOT / "docs" / "results.md").read_text().split("\n<!-- ", 1)[0]  # not other scripts' sections
    readme = (ROOT / "README.md").read_text()
    block = readme.split(results.README_BEGIN, 1)[1].split(results.README_END, 1)[0]
    table = page[page.index("\n| b | table's strategy"):].strip().split("\n\n")[0].splitlines()  # the first table
    conditions = next(line for line in page.splitlines() if line.startswith("Demo pair ("))
    assert table and all(line in block.splitlines() for line in table)
    assert conditions in block.splitlines()


def test_other_scripts_sections_survive_a_rewrite():
    previous = "# Results\n\nold\n\n<!-- runtime-costs:begin -->\ncosts\n<!-- runtime-costs:end -->\n"
    page = results.with_other_sections("# Results\n\nnew\n", previous)
    assert page == "# Results\n\nnew\n\n<!-- runtime-costs:begin -->\ncosts\n<!-- runtime-costs:end -->\n"
