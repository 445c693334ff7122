"""benchmarks/moesd.py: MoESD's setting (arXiv 2505.19645) in the latency model beside the paper's figures. The
speedup it computes rises with the batch size, then falls; the figures it transcribes agree with each other and
all stand in docs/results.md's moesd section; and that section is what the script writes now."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import moesd  # benchmarks/ is on sys.path (conftest.py), as the scripts import each other
from docs_sections import markers, sections

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "moesd.py"


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def curves() -> dict[str, list]:
    return moesd.headline_curves(moesd.Assumptions())


def test_the_section_in_docs_results_md_is_what_the_script_writes_now():
    """Oracle: docs/results.md's moesd section, rendered again with the defaults, comes out the same to the letter
    (the section has no timing of its own: it is a function of the paper's figures and the assumptions)."""
    started = time.monotonic()
    section = moesd.render(moesd.Assumptions())
    assert time.monotonic() - started < 5.0  # pure numpy/scipy: seconds, not minutes
    begin, end = markers(moesd.SECTION)
    committed = sections((ROOT / "docs" / "results.md").read_text())[moesd.SECTION]
    assert committed == f"{begin}\n{section}\n{end}"


def test_every_figure_taken_from_the_paper_stands_in_the_docs_section():
    committed = sections((ROOT / "docs" / "results.md").read_text())[moesd.SECTION]
    lines = committed.splitlines()
    assert len(moesd.TABLES) == 16 and all(sorted(row) == [2, 3, 4] for row in moesd.TABLES.values())
    for (platform, dataset, temperature), by_gamma in moesd.TABLES.items():
        row = next(line for line in lines if line.startswith(f"| {platform} | {dataset} | {temperature:g} | "))
        cells = row.split(" | ")[3:]
        for cell, (gamma, (t_ar, t_sd, sigma, x)) in zip(cells, sorted(by_gamma.items())):
            assert cell.startswith(f"{sigma:.2f}, {t_ar:.2f} / {t_sd:.2f} = **{x:.2f}x**;"), (platform, gamma, cell)
    # the platforms, the pair and the paper's headline figure (its abstract's 2.29x, Table 2's 2xH800 row)
    for name in ("2xA800", "2xH800", "4xA800", "4xL40", "Qwen2-57B-A14B-Instruct", "Qwen2-0.5B-Instruct",
                 "arXiv 2505.19645", "**2.29x** (Table 2)"):
        assert name in committed, name


def test_the_transcribed_tables_agree_with_themselves():
    """x = T_AR / T_SD in the paper, up to its rounding (x comes from unrounded times: 17.84 / 10.00 is printed
    1.79), and sigma (gamma + 1) tokens a round lie between 1 and gamma + 1."""
    for key, by_gamma in moesd.TABLES.items():
        for gamma, (t_ar, t_sd, sigma, x) in by_gamma.items():
            assert t_ar / t_sd == pytest.approx(x, abs=0.0065), (key, gamma)
            assert 1.0 < sigma * (gamma + 1) < gamma + 1 and x > 1.0, (key, gamma)
    best = max((x, key, gamma) for key, by_gamma in moesd.TABLES.items() for gamma, (*_, x) in by_gamma.items())
    assert best == (2.29, ("2xH800", "humaneval", 0.0), 4)  # "up to 2.29x speedup" (the abstract)


def test_sigma_becomes_the_acceptance_whose_tokens_per_round_it_names():
    from specbatch.perfmodel.acceptance import acceptance_from_user

    for (_, _, _), by_gamma in moesd.TABLES.items():
        for gamma, (_, _, sigma, _) in by_gamma.items():
            alpha = moesd.alpha_from_sigma(sigma, gamma)
            assert acceptance_from_user([alpha] * 8).expected_tokens(gamma) == pytest.approx(sigma * (gamma + 1))
    with pytest.raises(ValueError, match="outside"):
        moesd.alpha_from_sigma(0.2, 4)  # 1 token a round: nothing accepted, no alpha says that


def test_the_shapes_are_the_models_names():
    """57B parameters with 14B active (every expert counted once; the shared expert among the always-read part),
    and the draft's count equals the runtime's for the same shape (its qwen2.5-0.5b preset)."""
    from specbatch.runtime.config import config_from_dict
    from specbatch.runtime.presets import PRESETS

    target, draft = moesd.target_shape(), moesd.draft_shape()
    assert round(target.parameters / 1e9) == 57 and round(target.active_parameters / 1e9) == 14
    experts = target.experts
    assert (experts.num_experts, experts.experts_per_token, experts.moe_layers) == (64, 8, 28)
    shared_bytes = 28 * 3 * 3584 * 20480 * moesd.ELEMENT_BYTES
    dense_bytes = target.weight_bytes - experts.routed_bytes
    assert dense_bytes > shared_bytes  # read by every pass, whatever the routing
    assert target.weights_read_bytes(1, 1) == pytest.approx(dense_bytes + 28 * 8 * experts.expert_bytes)
    assert draft.parameters == config_from_dict(PRESETS["qwen2.5-0.5b"]).parameter_count() == 494_032_768


def test_the_speedup_rises_with_the_batch_size_then_falls(curves):
    """On every platform, at the paper's headline setting: one peak strictly inside the batch sizes, the curve
    rising to it and falling after it, and within the paper's own sweep (1-100) already below its peak at 100."""
    inside = len(moesd.PAPER_BATCH_SIZES)
    for platform, points in curves.items():
        speedups = np.array([p.fixed for p in points])
        top = int(np.argmax(speedups))
        assert 0 < top < len(points) - 1, (platform, speedups)
        assert np.all(np.diff(speedups[:top + 1]) >= -1e-9) and np.all(np.diff(speedups[top:]) <= 1e-9), platform
        assert speedups[0] < 0.6 * speedups[top] and speedups[-1] < 0.6 * speedups[top], (platform, speedups)
        assert moesd.rises_then_falls(points[:inside]), platform
        assert points[-1].best_k < points[top].best_k  # and the table's k falls with it


def test_without_the_expert_term_the_same_weights_only_fall(monkeypatch):
    """The rise is the expert term's: read as a dense model (every pass reads every expert), the target's speedup
    is largest at b = 1 and only falls with b (the paper's dense target, Fig. 3, App. A.2)."""
    moe = moesd.target_shape()
    monkeypatch.setattr(moesd, "target_shape", lambda: dataclasses.replace(moe, experts=None, routing=None))
    sigma = moesd.TABLES[("2xH800", "humaneval", 0.0)][4][2]
    speedups = [p.fixed for p in moesd.curve("2xH800", sigma, 4, moesd.PAPER_BATCH_SIZES, moesd.Assumptions(),
                                             best=False)]
    assert all(later <= earlier + 1e-9 for earlier, later in zip(speedups, speedups[1:])), speedups


def test_write_docs_replaces_its_own_section_and_keeps_the_others(tmp_path):
    page = tmp_path / "results.md"
    page.write_text("# Results\n\n<!-- gpu-data:begin -->\nkept\n<!-- gpu-data:end -->\n")
    for _ in range(2):
        run = run_script("--write-docs", "--results", str(page))
        assert run.returncode == 0, run.stderr
    text = page.read_text()
    assert text.startswith("# Results\n\n<!-- gpu-data:begin -->\nkept\n<!-- gpu-data:end -->\n")
    assert text.count("<!-- moesd:begin -->") == 1 and text.count("<!-- moesd:end -->") == 1
    assert "| 2xH800 | humaneval | 0 | " in run.stdout and run.stdout.rstrip().endswith(f"section of {page}")


def test_help_and_bad_options():
    run = run_script("--help")
    assert run.returncode == 0 and "MoESD's setting in the latency model" in " ".join(run.stdout.split())
    for args in (["--flops-fraction", "0"], ["--bandwidth-fraction", "1.5"], ["--max-k", "2"]):
        run = run_script(*args)
        assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].startswith("moesd.py: error:"), run.stderr
