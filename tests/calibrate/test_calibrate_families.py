"""`calibrate` on the new families' shapes: a Qwen3 target and a Gemma 3 draft given as config.json files
(random weights, the acceptance given), end to end through the CLI."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from specbatch import cli
from specbatch.perfmodel.profile import load_profile

_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def test_calibrate_times_a_qwen3_target_with_a_gemma3_draft(tmp_path):
    target, draft, out = tmp_path / "qwen3.json", tmp_path / "gemma3.json", tmp_path / "profile.json"
    target.write_text(json.dumps(dict(_SMALL, model_type="qwen3", num_hidden_layers=2, head_dim=16)))
    draft.write_text(json.dumps(dict(_SMALL, model_type="gemma3_text", num_hidden_layers=2, head_dim=16,
                                     sliding_window=8, sliding_window_pattern=2)))
    result = CliRunner().invoke(cli.app, [
        "calibrate", "--target", str(target), "--draft", str(draft), "--acceptance", "0.8", "--quick",
        "--batch-sizes", "1", "--max-k", "2", "--context-lens", "16", "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    assert profile.target.random_weights and profile.draft.random_weights
    assert {row.model for row in profile.timings if row.feasible and row.median_ms > 0} == {"target", "draft"}
