"""Bad options: `BenchConfig` refuses what the harness cannot measure, and `specbatch bench` says so
in one line on stderr with exit code 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specbatch.bench.config import BenchConfig, BenchError
from specbatch.bench.outputs import BENCH_SCHEMA
from specbatch.runtime.sampling import Sampling


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("changes, message", [
    (dict(synthetic_acceptance=0.0), "--synthetic-acceptance"),
    (dict(synthetic_acceptance=1.5), "--synthetic-acceptance"),
    (dict(ks=()), "--ks"),
    (dict(ks=(-1,)), "--ks"),
    (dict(rounds=0), "--rounds"),
    (dict(synthetic_acceptance=0.5, peers=("transformers",)), "--peers"),
    (dict(peers=("sglang",)), "--peers: unknown peer 'sglang'"),
    (dict(peers=("vllm",)), "--peers vllm needs --table"),
    (dict(peers=("vllm",), table_path=Path("t.json"), sampling=Sampling(temperature=0.8)), "use --sampling greedy"),
])
def test_config_refuses_bad_values(changes, message):
    with pytest.raises(BenchError, match=message):
        BenchConfig(**changes)


@pytest.mark.parametrize("changes, message", [
    (dict(synthetic_acceptance=0.5, trees=("0,1",)), "--tree cannot be combined with --synthetic-acceptance"),
    (dict(synthetic_acceptance=0.5, stage2_path=Path("n.bin")), "--stage2 cannot be combined"),
    (dict(trees=("0,1.0",)), "--tree: path 1.0 has no parent 1"),
    (dict(trees=("chain:0",)), "--tree"),
])
def test_config_refuses_trees_it_cannot_run(changes, message):
    with pytest.raises(BenchError, match=message):
        BenchConfig(**changes)


# ---------------------------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def cli_pair(tmp_path_factory, vocab_size):
    """Two tiny Hugging Face directories without tokenizer (the bench then uses 64-token random prompts)."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("cli_pair")
    for name, layers in (("target", 2), ("draft", 1)):
        config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=layers,
                                          num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                                          max_position_embeddings=96, eos_token_id=2, pad_token_id=0)
        transformers.LlamaForCausalLM(config).save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


def _invoke(args):
    from specbatch.cli import app

    return CliRunner().invoke(app, ["bench", *args])


@pytest.mark.parametrize("args, message", [
    (["--synthetic-acceptance", "0"], "--synthetic-acceptance"),
    (["--synthetic-acceptance", "1.01"], "--synthetic-acceptance"),
    (["--ks", ""], "--ks"),
    (["--ks", "0,x"], "--ks"),
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--rounds", "0"], "--rounds"),
    (["--sampling", "warm"], "--sampling"),
    (["--peers", "transformers,tgi"], "--peers: unknown peer 'tgi'"),
    (["--peers", "vllm"], "--peers vllm needs --table"),
    (["--table", "/no/such/table.json"], "--table"),
    (["--target", "no-such-preset", "--synthetic-acceptance", "0.8"], "--target"),
    (["--target", "gpt2", "--draft", "gpt2"], "--synthetic-acceptance"),  # random weights need α
])
def test_cli_bad_input_is_one_line_exit_2(args, message):
    result = _invoke(args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]


def test_cli_peers_vllm_without_its_environment_is_one_line(cli_pair, write_table, tmp_path, monkeypatch):
    """Refused before anything is measured, saying how to set vLLM up."""
    monkeypatch.setenv("SPECBATCH_VLLM_VENV", str(tmp_path / "no-venv"))
    target, draft = cli_pair
    result = _invoke(["--target", target, "--draft", draft, "--table", write_table({1: 2}), "--ks", "0",
                      "--batch-sizes", "1", "--max-new-tokens", "3", "--peers", "vllm", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--peers vllm: vLLM is not set up" in lines[0] and "setup.sh" in lines[0]
    assert not (tmp_path / "bench.json").exists()


def test_cli_refuses_table_beyond_the_cache_margin(cli_pair, write_table, tmp_path):
    target, draft = cli_pair
    table = write_table({1: 12})  # 64 prompt + 24 new + 12 > 96 positions
    result = _invoke(["--target", target, "--draft", draft, "--table", table, "--ks", "0,1", "--batch-sizes", "1",
                      "--max-new-tokens", "24", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "KV-cache margin" in lines[0]


def test_cli_json_is_one_object(cli_pair, tmp_path):
    target, draft = cli_pair
    result = _invoke(["--target", target, "--draft", draft, "--ks", "0,1", "--batch-sizes", "1,2", "--rounds", "1",
                      "--max-new-tokens", "3", "--synthetic-acceptance", "0.5", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == BENCH_SCHEMA and "SYNTHETIC" in doc["synthetic"]
    assert sorted(doc["outputs"]) == sorted(str(tmp_path / name) for name in
                                            ("bench.json", "bench.csv", "goodput_vs_k.png", "speedup_vs_batch.png"))
