"""Routing measured by calibrate on a mixture-of-experts model: the recorded experts against transformers' router,
the distinct-expert counts against hand counts, and the profile -> model -> table path through the CLI."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from specbatch import cli
from specbatch.calibrate.routing import TextWindows, distinct_per_layer, record_routes, recording_routes
from specbatch.perfmodel.model import load_model
from specbatch.perfmodel.profile import load_profile
from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_TARGET
from specbatch.runtime.checkpoint import load_checkpoint

transformers = pytest.importorskip("transformers")


def _tiny_qwen3_moe(vocab_size: int = 259):
    # 16 experts, top-2, every layer routed but the dense layer 1; normalised top-k weights
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=16, num_experts_per_tok=2,
        mlp_only_layers=[1], norm_topk_prob=True, max_position_embeddings=1024, bos_token_id=256, eos_token_id=257,
        pad_token_id=258))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny random qwen3_moe checkpoint with the demo pair's byte tokenizer, so the demo draft can draft for it."""
    from torch_fixtures import randomize_

    torch.manual_seed(0)
    model = randomize_(_tiny_qwen3_moe(), seed=11)
    directory = tmp_path_factory.mktemp("moe")
    model.save_pretrained(str(directory))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TARGET / name, directory / name)
    return model, directory


def test_the_recorded_routes_are_transformers_routers_top_k(moe_dir):
    reference, directory = moe_dir
    ours = load_checkpoint(directory, "cpu", torch.float32).model
    prompt = [int(t) for t in torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))]
    [routes] = record_routes(ours, [prompt])  # (tokens, routed layers, top-k)
    with torch.no_grad():
        out = reference(torch.tensor([prompt]), output_router_logits=True)
    logits = [layer for layer in out.router_logits if layer is not None]
    assert routes.shape == (40, 2, 2) and len(logits) == 2  # layers 0 and 2 route; layer 1 is dense
    for layer, router_logits in enumerate(logits):
        expected = torch.topk(router_logits.reshape(40, 16), 2, dim=-1).indices.numpy()
        assert (np.sort(routes[:, layer], axis=-1) == np.sort(expected, axis=-1)).all()
    with recording_routes(ours):
        pass
    assert "route" not in vars(ours.layers[0].experts)  # the recorder leaves the module as it found it


def test_distinct_experts_in_windows_are_counted_by_hand():
    # prompt A routes every token to experts {0, 1} in both layers, prompt B to {2, 3} in layer 0 and {2, 5} then
    # {2, 6} alternating in layer 1
    a = np.tile(np.array([[[0, 1], [0, 1]]]), (6, 1, 1))
    b = np.array([[[2, 3], [2, 5 + t % 2]] for t in range(6)])
    rng = np.random.default_rng(0)
    one_row = distinct_per_layer([b], 8, 1, 3, rng, windows=16)
    assert one_row.tolist() == [2.0, 3.0]  # 3 consecutive tokens of B: {2, 3}; {2, 5, 6}
    two_rows = distinct_per_layer([a, b], 8, 2, 1, rng, windows=16)
    assert two_rows.tolist() == [4.0, 4.0]  # rows from different prompts while there are enough: A's and B's
    assert distinct_per_layer([a], 8, 1, 7, rng) is None  # no prompt is 7 tokens long


def test_text_windows_are_rows_of_consecutive_tokens_from_different_prompts():
    prompts = [list(range(100 * p, 100 * p + 20)) for p in range(5)]
    windows = TextWindows(prompts)
    tokens = windows(4, 3, seed=7)
    assert tokens.shape == (4, 3)
    firsts = tokens[:, 0].tolist()
    assert len({t // 100 for t in firsts}) == 4  # four different prompts
    assert (tokens[:, 1:] - tokens[:, :-1] == 1).all()  # consecutive
    assert torch.equal(windows(4, 3, seed=7), tokens)  # a point's samples route alike


def _calibrate(target, draft, out, *extra):
    result = CliRunner().invoke(cli.app, [
        "calibrate", "--target", str(target), "--draft", str(draft), "--quick", "--batch-sizes", "1,2,4",
        "--max-k", "2", "--context-lens", "16", "--device", "cpu", "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    return load_profile(out)


def test_calibrate_measures_a_checkpoints_routing_over_prompts_and_the_table_carries_it(moe_dir, tmp_path):
    _, directory = moe_dir
    profile = _calibrate(directory, DEMO_DRAFT, tmp_path / "profile.json")
    experts = profile.target.experts
    assert (experts.num_experts, experts.experts_per_token, experts.moe_layers) == (16, 2, 2)
    assert experts.expert_parameters == 3 * 32 * 16 and profile.draft.experts is None
    routing = profile.routing
    assert routing.source == "prompts" and routing.prompt_count > 4
    shapes = {(row.batch_size, row.new_tokens) for row in routing.rows}
    grid = profile.grid  # every pass the target's rows time: verify widths, and the trees' wider ones
    assert shapes == {(b, n) for b in grid.batch_sizes for n in grid.target_new_tokens}
    for row in routing.rows:
        assert len(row.distinct_experts) == 2
        if row.tokens == 1:
            assert row.distinct_experts == (2.0, 2.0)  # one token: exactly its top-2
        assert max(row.distinct_experts) <= min(16, 2 * row.tokens)
    fitted = CliRunner().invoke(cli.app, ["fit", str(tmp_path / "profile.json"), "-o", str(tmp_path / "model.json")])
    assert fitted.exit_code == 0, fitted.output
    assert "experts touched a layer" in fitted.output
    model = load_model(tmp_path / "model.json")
    routing_fit = model.roles["target"].model.shape.routing
    assert routing_fit.source == "measured" and routing_fit.rows == len(routing.rows)
    assert model.experts_touched("target", 1, 1) == pytest.approx(2.0)
    assert model.experts_touched("draft", 1, 1) is None
    assert not model.routing_notes()  # the model's own routing: nothing to warn about
    table = CliRunner().invoke(cli.app, ["table", str(tmp_path / "model.json"), "-o", str(tmp_path / "table.json")])
    assert table.exit_code == 0, table.output
    written = json.loads((tmp_path / "table.json").read_text())
    assert written["experts"]["target"]["routing"]["source"] == "measured"
    for entry in written["buckets"][0]["entries"]:  # the verify pass's experts: b rows x (nodes + 1) tokens
        nodes = len(entry["strategy"]["tree"] or ())  # a chain of k is a tree of k nodes
        expected = model.experts_touched("target", entry["batch_size"], nodes + 1)
        assert entry["experts_touched"] == pytest.approx(expected, rel=1e-3)
    # the table runs: speculative greedy output equals the target's own
    def generate(*options):
        result = CliRunner().invoke(cli.app, ["generate", "--target", str(directory), "--draft", str(DEMO_DRAFT),
                                              "--prompt", "def add(a, b):", "--prompt", "import os",
                                              "--max-new-tokens", "24", "--json", *options])
        assert result.exit_code == 0, result.output
        [line] = [line for line in result.output.splitlines() if line.startswith('{"outputs"')]  # notes aside
        return [row["text"] for row in json.loads(line)["outputs"]]

    assert generate("--table", str(tmp_path / "table.json")) == generate("--k", "0")


def test_random_weights_record_that_their_routing_is_not_a_models(tmp_path):
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    target, draft = tmp_path / "moe.json", tmp_path / "draft.json"
    target.write_text(json.dumps(dict(small, model_type="qwen3_moe", num_hidden_layers=2, head_dim=16, num_experts=16,
                                      num_experts_per_tok=2, moe_intermediate_size=16)))
    draft.write_text(json.dumps(dict(small, model_type="qwen3", num_hidden_layers=1, head_dim=16)))
    profile = _calibrate(target, draft, tmp_path / "profile.json", "--acceptance", "0.8")
    assert profile.routing.source == "random_weights" and profile.routing.prompts == "random tokens"
    fitted = CliRunner().invoke(cli.app, ["fit", str(tmp_path / "profile.json"), "-o", str(tmp_path / "model.json")])
    assert fitted.exit_code == 0, fitted.output
    table = CliRunner().invoke(cli.app, ["table", str(tmp_path / "model.json"), "-o", str(tmp_path / "table.json")])
    assert table.exit_code == 0, table.output
    assert "measured on random weights, which route unlike a trained model" in " ".join(table.output.split())
