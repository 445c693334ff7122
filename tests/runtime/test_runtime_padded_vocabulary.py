"""A draft whose vocabulary is the first ids of its target's (one tokenizer, the target's embedding table
padded past it: Gemma 3 1B, 262,144 ids, drafting for Gemma 3 12B's 262,208): its logits are padded with -inf,
an id past its table is read as its last row, and generation stays lossless. The loader allows it only when
the tokenizer files are the same (or for random weights of one model type)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specbatch.perfmodel.errors import UsageError
from specbatch.perfmodel.tree import parse_tree, Strategy
from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_TARGET
from specbatch.runtime.checkpoint import build_model
from specbatch.runtime.generator import GenerationError, SpeculativeGenerator
from specbatch.runtime.loading import load_pair, resolve_pair
from specbatch.runtime.policy import FixedK, FixedStrategy
from torch_fixtures import tiny_llama_config

EXTRA = 5  # ids the padded target has beyond the draft's


def test_a_padded_draft_proposes_only_its_own_ids_and_reads_the_targets_as_its_last():
    draft = build_model(tiny_llama_config(vocab_size=60), seed=3)
    ids = torch.tensor([[1, 7, 59]])
    plain = draft(ids)
    draft.pad_vocabulary_to(64)
    padded = draft(ids)
    assert padded.shape == (1, 3, 64) and torch.equal(padded[..., :60], plain)
    assert torch.isneginf(padded[..., 60:]).all()
    assert torch.equal(draft(torch.tensor([[1, 7, 63]])), padded)  # id 63 is read as 59, the last of ours
    with pytest.raises(ValueError, match="cannot hold"):
        draft.pad_vocabulary_to(59)


@pytest.mark.parametrize("strategy", [FixedK(3), FixedStrategy(Strategy(parse_tree("0,1,0.0,0.1,1.0")))],
                         ids=["chain k=3", "tree"])
def test_generation_with_a_padded_draft_is_target_only_greedy(greedy_target, greedy_draft_sometimes, prompts8,
                                                              strategy):
    """The draft's table is the target's first 60 ids (the target's own ids 60-63 reach the draft as 59)."""
    draft = build_model(tiny_llama_config(vocab_size=60), seed=0)
    with torch.no_grad():  # the target's draft of the fixtures, its rows past 60 cut off
        draft.embed.weight.copy_(greedy_draft_sometimes.embed.weight[:60])
        draft.lm_head.weight.copy_(greedy_draft_sometimes.lm_head.weight[:60])
        for mine, theirs in zip(draft.layers.parameters(), greedy_draft_sometimes.layers.parameters()):
            mine.copy_(theirs)
        draft.final_norm.weight.copy_(greedy_draft_sometimes.final_norm.weight)
    with pytest.raises(GenerationError, match="vocabulary"):
        SpeculativeGenerator(greedy_target, draft)
    draft.pad_vocabulary_to(greedy_target.config.vocab_size)
    prompts = [p + [61, 63] for p in prompts8]  # ids the draft has no row for
    expected = SpeculativeGenerator(greedy_target, None).generate(prompts, 12, FixedK(0)).token_ids
    result = SpeculativeGenerator(greedy_target, draft).generate(prompts, 12, strategy)
    assert result.token_ids == expected
    assert sum(result.stats.accepted_per_position) > 0  # the draft did propose accepted tokens


def _padded_target(directory):
    """The demo target with EXTRA more ids: its (tied) table padded with zero rows, its tokenizer unchanged."""
    shutil.copytree(DEMO_TARGET, directory)
    weights = load_file(directory / "model.safetensors")
    table = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = torch.cat([table, table.new_zeros(EXTRA, table.shape[1])])
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["vocab_size"] += EXTRA
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_the_loader_pads_a_draft_of_the_same_tokenizer_and_refuses_another(tmp_path):
    target = _padded_target(tmp_path / "target")
    target_spec, draft_spec = resolve_pair(str(target), str(DEMO_DRAFT))
    pair = load_pair(target_spec, draft_spec, "cpu", torch.float32)
    assert pair.draft.logits_size == pair.target.config.vocab_size == 259 + EXTRA
    prompts = [pair.tokenizer.encode(text) for text in ("def add(a, b):", "import numpy as np\n")]
    expected = SpeculativeGenerator(pair.target, None).generate(prompts, 16, FixedK(0)).token_ids
    assert SpeculativeGenerator(pair.target, pair.draft).generate(prompts, 16, FixedK(4)).token_ids == expected

    other = tmp_path / "other-draft"
    shutil.copytree(DEMO_DRAFT, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(UsageError, match="maps tokens to ids unlike the target's"):
        resolve_pair(str(target), str(other))
    (other / "tokenizer.json").unlink()  # unknown tokens: sizes must then agree
    with pytest.warns(Warning, match="has no tokenizer.json"), pytest.raises(UsageError, match="share one tokenizer"):
        resolve_pair(str(target), str(other))


def test_random_weights_of_one_model_type_pair_up_like_gemma_3_1b_and_12b():
    target, draft = resolve_pair("gemma-3-12b", "gemma-3-1b")
    assert draft.config.vocab_size < target.config.vocab_size
    with pytest.raises(UsageError, match="share one tokenizer"):
        resolve_pair("gemma-3-12b", "qwen3-0.6b")
