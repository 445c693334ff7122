"""The bundled demo pair: it loads in our runtime and in transformers with the same logits, its
tokenizer round-trips arbitrary bytes, the prompts are held out, and the training script runs."""
from __future__ import annotations

import importlib.util
import json
import sysconfig
from pathlib import Path

import pytest
import torch

from specbatch.runtime.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "data" / "models"
PROMPTS = ROOT / "data" / "prompts" / "heldout.jsonl"
PAIR = [MODELS / "demo-target", MODELS / "demo-draft"]


def _training_module():
    spec = importlib.util.spec_from_file_location("train_demo_pair", ROOT / "data" / "train_demo_pair.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def target():
    return load_checkpoint(PAIR[0])


@pytest.fixture(scope="module")
def draft():
    return load_checkpoint(PAIR[1])


def test_pair_shapes_and_budget(target, draft):
    assert target.config.model_type == draft.config.model_type == "llama"
    assert target.config.vocab_size == draft.config.vocab_size == 259
    assert target.config.max_position_embeddings >= 512
    target_params = target.config.parameter_count()
    draft_params = draft.config.parameter_count()
    assert target_params >= 4_000_000
    assert draft_params * 10 <= target_params
    assert sum(p.numel() for p in target.model.parameters()) == target_params
    size = sum(f.stat().st_size for d in PAIR for f in d.iterdir())
    assert size <= 60 * 2**20


@pytest.mark.parametrize("text", ["def fibonacci(n):\n", "naïve café — ünïcödé ✓ 日本語", "\x00\x01\xff tabs\tand\r\n"])
def test_tokenizer_round_trips_bytes(target, text):
    ids = target.tokenizer.encode(text)
    assert ids[0] == 256  # BOS
    assert ids[1:] == list(text.encode("utf-8"))
    assert target.tokenizer.decode(ids) == text


def test_logits_match_transformers(target, draft):
    transformers = pytest.importorskip("transformers")
    prompts = ["def fibonacci(n):\n    ", "import os\nimport sys\n\nclass Path:"]
    for ours in (target, draft):
        theirs = transformers.AutoModelForCausalLM.from_pretrained(ours.path, dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(ours.path)
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            assert ids[0].tolist() == ours.tokenizer.encode(prompt)
            with torch.no_grad():
                expected = theirs(ids).logits
                got = ours.model(ids)
            assert (got - expected).abs().max().item() <= 1e-4


def test_prompts_are_held_out():
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()
    prompts = [json.loads(line) for line in lines]
    assert 100 <= len(prompts) <= 1000
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    assert len(set(prompts)) == len(prompts)
    split = json.loads((MODELS / "split.json").read_text())
    train, heldout = set(split["files"]["train"]), set(split["files"]["heldout"])
    assert not train & heldout
    module = _training_module()
    assert all(module.split_of(f) == "train" for f in train)
    assert all(module.split_of(f) == "heldout" for f in heldout)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    present = [stdlib / f for f in sorted(train | set(split["files"]["validation"])) if (stdlib / f).is_file()]
    assert present, "none of the training files exist on this machine"
    seen = b"\0".join(path.read_bytes() for path in present)
    leaked = [p for p in prompts if p.encode() in seen]
    assert not leaked, f"{len(leaked)} prompts occur verbatim in training files, e.g. {leaked[0]!r}"


def test_training_smoke(tmp_path):
    module = _training_module()
    report = module.main(["--smoke", "--out", str(tmp_path), "--run-dir", str(tmp_path / "run"), "--quiet"])
    assert report["target_parameters"] > report["draft_parameters"] > 0
    assert (tmp_path / "run" / "target.pt").is_file()
    loaded = load_checkpoint(tmp_path / "models" / "demo-draft")
    assert loaded.config.num_layers == 1
    ids = torch.tensor([loaded.tokenizer.encode("def f():")])
    assert torch.isfinite(loaded.model(ids)).all()
    # resuming a finished run trains nothing more and gives the same weights
    again = module.main(["--smoke", "--out", str(tmp_path / "again"), "--run-dir", str(tmp_path / "run"),
                         "--quiet", "--resume"])
    assert again["target_validation_bits_per_byte"] == pytest.approx(report["target_validation_bits_per_byte"])
