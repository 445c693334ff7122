"""Shared by the bench tests: a tiny random pair (our own CausalLM), random prompts, a small table and
a tiny n-gram second stage, all over the same 64-token vocabulary."""
from __future__ import annotations

from torch_fixtures import *  # noqa: F401,F403 - fixtures are found by name

import pytest

from specbatch.bench.config import BenchModels
from specbatch.bench.workload import random_prompts
from specbatch.runtime.checkpoint import build_model

VOCAB = 64  # tests/conftest.py's tiny Llama vocabulary


@pytest.fixture(scope="session")
def vocab_size():
    return VOCAB


@pytest.fixture(scope="module")
def tiny_pair(llama_config_factory):
    target = build_model(llama_config_factory(max_position_embeddings=256), seed=1)
    draft = build_model(llama_config_factory(num_layers=1, max_position_embeddings=256), seed=2)
    return BenchModels(target=target, draft=draft, target_source="tiny-target", draft_source="tiny-draft",
                       random_weights=True)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, 6, VOCAB, seed=3)


@pytest.fixture(scope="module")
def table_path(write_table):
    return write_table({1: 2, 2: 1, 3: 1})


@pytest.fixture(scope="module")
def ngram():
    """A tiny second stage over the test vocabulary: a trigram model of random sequences."""
    from specbatch.runtime.ngram import NGramModel

    return NGramModel.fit(random_prompts(20, 30, VOCAB, seed=9), VOCAB)
