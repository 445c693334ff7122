"""The bundled demo mixture-of-experts target (data/models/demo-moe, data/train_demo_moe.py): the training script's
smoke run exports a qwen3_moe directory in the Hub's per-expert layout that our runtime and transformers both load
with the same logits, and resumes; the shipped model has the demo pair's tokenizer, fits its size budget, matches
transformers, and its router spreads held-out text over its experts."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from specbatch.runtime.checkpoint import load_checkpoint
from test_runtime_families import _assert_close, _hf_logits  # the 1e-4 float32 parity check

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "data" / "models"
SHIPPED = MODELS / "demo-moe"
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\nclass Path:", "\x00\xff naïve ✓"]
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _training_module():
    return importlib.import_module("specbatch.data.train_demo_moe")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-moe-smoke")
    report = _training_module().main(["--smoke", "--out", str(out / "demo-moe"), "--run-dir", str(out / "run"),
                                      "--quiet"])
    return out, report


def _assert_matches_transformers(directory: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ours = load_checkpoint(directory)
    assert ours.model.lm_head.weight.dtype == torch.float32
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            assert ids[0].tolist() == ours.tokenizer.encode(prompt)
            expected = _hf_logits(theirs, ids)
            _assert_close(ours.model(ids), expected)
            cache = ours.model.new_cache(1, ids.shape[1])  # the cached path: a prefill, then token by token
            pieces = [ours.model(ids[:, :4], cache)] + [ours.model(ids[:, t:t + 1], cache)
                                                        for t in range(4, ids.shape[1])]
            _assert_close(torch.cat(pieces, dim=1), expected)


def test_smoke_run_exports_a_qwen3_moe_directory_in_the_hubs_layout(smoke):
    from safetensors import safe_open

    out, report = smoke
    directory = out / "demo-moe"
    assert sorted(p.name for p in directory.iterdir()) == sorted(FILES)
    assert (out / "run" / "moe.pt").is_file() and (out / "run" / "report.json").is_file()
    raw = json.loads((directory / "config.json").read_text())
    assert raw["model_type"] == "qwen3_moe" and raw["norm_topk_prob"] is True
    loaded = load_checkpoint(directory)
    config = loaded.config
    assert (config.num_experts, config.experts_per_token, config.vocab_size) == (4, 2, 259)
    assert all(config.routes_experts(i) for i in range(config.num_layers))
    assert report["parameters"] == config.parameter_count() == sum(p.numel() for p in loaded.model.parameters())
    with safe_open(str(directory / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        assert {weights.get_tensor(name).dtype for name in names} == {torch.float16}
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert "lm_head.weight" not in names  # tied
    assert all(len(layer["distinct_experts_per_span"]) == 3 for layer in report["routing_heldout"]["layers"])


def test_smoke_export_loads_in_our_runtime_and_transformers_with_the_same_logits(smoke):
    _assert_matches_transformers(smoke[0] / "demo-moe")


def test_smoke_run_resumes_without_training_more(smoke, tmp_path):
    out, report = smoke
    again = _training_module().main(["--smoke", "--out", str(tmp_path / "demo-moe"), "--run-dir", str(out / "run"),
                                     "--quiet", "--resume"])
    assert again["bits_per_byte"] == report["bits_per_byte"]
    assert (tmp_path / "demo-moe" / "model.safetensors").read_bytes() == \
        (out / "demo-moe" / "model.safetensors").read_bytes()


def test_shipped_model_shape_budget_and_the_demo_pairs_tokenizer():
    assert sorted(p.name for p in SHIPPED.iterdir()) == sorted(FILES)
    loaded = load_checkpoint(SHIPPED)
    config = loaded.config
    assert config.model_type == "qwen3_moe" and config.normalize_expert_weights
    assert (config.num_experts, config.experts_per_token, config.vocab_size) == (16, 2, 259)
    assert (SHIPPED / "model.safetensors").stat().st_size <= 12 * 10**6
    # demo-draft drafts for it: the same tokenizer, byte for byte
    assert (SHIPPED / "tokenizer.json").read_bytes() == (MODELS / "demo-draft" / "tokenizer.json").read_bytes()


def test_shipped_model_matches_transformers():
    _assert_matches_transformers(SHIPPED)


def test_shipped_router_spreads_held_out_text_over_the_experts():
    """No expert layer has collapsed: on held-out prompts every layer sends at least 1 % of its assignments to at
    least 12 of its 16 experts, and none takes more than a third."""
    module = _training_module()
    loaded = load_checkpoint(SHIPPED)
    prompts = [json.loads(line) for line in (ROOT / "data" / "prompts" / "heldout.jsonl").read_text().splitlines()]
    text = "".join(prompts[:40])
    ids = torch.tensor([loaded.tokenizer.encode(text)[:2048]])
    tap = module.RouterTap(loaded.model)
    with torch.no_grad():
        loaded.model(ids)
    loads = module.expert_loads(tap.take(), loaded.config.experts_per_token).double()
    tap.close()
    share = loads / loads.sum(dim=1, keepdim=True)
    assert share.shape == (loaded.config.num_layers, 16)
    assert ((share >= 0.01).sum(dim=1) >= 12).all(), share
    assert (share.max(dim=1).values <= 1 / 3).all(), share
