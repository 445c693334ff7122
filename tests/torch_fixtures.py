"""Fixtures for the tests that run torch: tiny models, built in milliseconds.

The conftest.py of each torch-using test folder (runtime, calibrate, bench, cli) star-imports this
module, so its fixtures exist there and nowhere else: tests/perfmodel runs without torch installed.

Two kinds of tiny models:
  * our own `CausalLM` built from a `ModelConfig` with random weights (`build_model(config, seed=...)`),
    made "peaked" (large logits) so that greedy argmax never hinges on float rounding;
  * Hugging Face `transformers` models with random weights, saved to a temporary directory and read
    back with `runtime.checkpoint.load_checkpoint` (the parity tests' oracle).

Tests use the helpers through fixtures (not by importing this file).
"""
from __future__ import annotations

import json

import pytest
import torch

from specbatch.runtime.checkpoint import build_model
from specbatch.runtime.config import ModelConfig

VOCAB = 64


def tiny_llama_config(**overrides) -> ModelConfig:
    """A ~30k-parameter Llama with grouped-query attention (4 heads, 2 KV heads)."""
    fields = dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, intermediate_size=64, max_position_embeddings=128, norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def make_peaked(model, scale: float = 40.0):
    """Scale the LM head so logits spread over tens of units: argmax gaps dwarf float rounding."""
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.25) -> torch.nn.Module:
    """Give a `transformers` model large random weights, so that a wrong formula moves the logits a lot.

    transformers' default init (std 0.02) makes attention almost uniform and most mistakes invisible
    at 1e-4; here matrices get std `std`, embeddings std 1, norm weights 1 +- 0.2, biases +-0.2.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() == 1:
                is_norm = any(tag in name for tag in ("norm", "ln_", "layer_norm"))
                param.copy_(1.0 + 0.2 * noise if (is_norm and name.endswith("weight")) else 0.2 * noise)
            elif any(tag in name for tag in ("embed", "wte", "wpe")):
                param.copy_(noise)
            else:
                param.copy_(std * noise)
    return model.eval()


def moved(model, device, dtype):
    """`model` (a CausalLM or a DraftHead) moved to `device` in `dtype`, its RoPE tables kept in float32 as the
    product makes them (a plain `.to(dtype)` would round the inverse frequencies to the weights' dtype)."""
    model.to(device, dtype)
    model.set_rope_frequencies(device)
    return model


def save_hf(model, directory, **kwargs):
    """`save_pretrained` and return the directory as a string."""
    model.save_pretrained(str(directory), **kwargs)
    return str(directory)


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def llama_config_factory():
    return tiny_llama_config


@pytest.fixture(scope="session")
def peaked():
    return make_peaked


@pytest.fixture(scope="session")
def randomize():
    return randomize_


@pytest.fixture(scope="session")
def greedy_target():
    """Target for the greedy tests: untied (so a draft may permute its LM head), peaked logits."""
    return make_peaked(build_model(tiny_llama_config(), seed=1))


def noisy_copy(target, num_layers: int, noise: float, seed: int):
    """A different, smaller model that agrees with `target` part of the time: the target's weights (its
    first `num_layers` layers) plus Gaussian noise of `noise` times each tensor's std. Two independent
    random models would agree on about 1/vocab of the argmaxes: never, in practice."""
    from dataclasses import replace

    config = replace(target.config, num_layers=num_layers, tie_word_embeddings=False)
    draft = build_model(config, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    source = target.state_dict()
    with torch.no_grad():
        for name, param in draft.named_parameters():
            base = source[name].float()
            param.copy_(base + noise * base.std() * torch.randn(base.shape, generator=gen))
    return draft


@pytest.fixture(scope="session")
def make_noisy_copy():
    return noisy_copy


@pytest.fixture(scope="session")
def greedy_draft_sometimes(greedy_target):
    return noisy_copy(greedy_target, num_layers=1, noise=0.3, seed=2)


@pytest.fixture(scope="session")
def greedy_draft_never(greedy_target):
    """A draft that always disagrees: the target with its LM-head rows shifted cyclically by one, so its
    logits are the target's logits permuted (argmax_draft = argmax_target - 1 mod V, never equal)."""
    draft = build_model(greedy_target.config, seed=0)
    draft.load_state_dict(greedy_target.state_dict())
    with torch.no_grad():
        draft.lm_head.weight.copy_(torch.roll(greedy_target.lm_head.weight, shifts=1, dims=0))
    return draft


@pytest.fixture(scope="session")
def prompts8():
    """Eight prompts of different lengths (3..17 tokens)."""
    gen = torch.Generator().manual_seed(11)
    lengths = [5, 3, 9, 4, 17, 7, 12, 6]
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="session")
def write_table(tmp_path_factory):
    """Write a `specbatch.table/1` file mapping batch size -> k (one context bucket)."""

    def write(mapping: dict[int, int], name: str = "table.json") -> str:
        entries = [
            {"batch_size": b, "k": k, "predicted_tokens_per_s": 1.0, "predicted_speedup": 1.0,
             "runner_up_k": None, "margin": None}
            for b, k in sorted(mapping.items())
        ]
        table = {
            "schema": "specbatch.table/1", "target": "t", "draft": "d", "device": "cpu",
            "created_utc": "2026-11-30T00:00:00Z", "max_k": max(mapping.values()), "acceptance": {},
            "buckets": [{"context_len": 128, "entries": entries}],
        }
        path = tmp_path_factory.mktemp("table") / name
        path.write_text(json.dumps(table))
        return str(path)

    return write


def tune_cpu(monkeypatch, **fields):
    """The CPU's device record with `fields` changed, for the rest of the test (runtime.devices)."""
    from dataclasses import replace

    from specbatch.runtime import devices

    tuned = replace(devices.KINDS["cpu"], **fields)
    monkeypatch.setitem(devices.KINDS, "cpu", tuned)
    return tuned
