"""Calibrating a head end to end on a tiny real target: the passes a head makes are timed (chains' and trees'), its
acceptance is measured by drafting (per position, and per depth and rank along the target's path, for trees), the
profile says which drafter it measured, and fit and table rank chains and trees for it."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from specbatch.calibrate.errors import CalibrationError
from specbatch.calibrate.run import calibrate
from specbatch.perfmodel.fit import fit_profile
from specbatch.perfmodel.model import compute_table
from specbatch.perfmodel.profile import load_profile
from specbatch.runtime.checkpoint import build_model
from specbatch.runtime.heads import random_head, save_head
from specbatch.runtime.heads.config import head_config_from_dict

from test_calibrate_run import PROMPTS, _export_function, request


@pytest.fixture(scope="module")
def head_pair(tmp_path_factory):
    """A tiny byte-level Llama target on disk whose next token is a function of the current one (its attention and
    MLP outputs zeroed), an EAGLE-3 head (random, a draft vocabulary of 200 of 259 ids) and an MTP head that computes
    the target's next token from the token's embedding, its token norm perturbed so that it is sometimes wrong; and a
    prompts file."""
    export, demo = _export_function()
    root = tmp_path_factory.mktemp("head-pair")
    config = replace(demo, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                     max_position_embeddings=160)
    target = build_model(config, seed=1)
    with torch.no_grad():
        for layer in target.layers:
            layer.o.weight.zero_()
            layer.down.weight.zero_()
        target.lm_head.weight.mul_(10.0)  # tied to the embedding: peaked logits
        # a random final norm: the next token is another token (with the embedding as the LM head and unit norm
        # weights, a token's own embedding scores highest and every continuation would repeat one token)
        target.final_norm.weight.copy_(torch.randn(32, generator=torch.Generator().manual_seed(5)))
    export(target, config, root / "target")
    layer = {"model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": 32, "intermediate_size": 48,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": config.norm_eps}
    eagle = head_config_from_dict({"speculators_model_type": "eagle3", "transformer_layer_config": layer,
                                   "draft_vocab_size": 200, "eagle_aux_hidden_state_layer_ids": [0, 1, 3]}, config, "h")
    save_head(random_head(eagle, target, seed=2), root / "eagle3-head", verifier=str(root / "target"))
    mtp = random_head(head_config_from_dict({"speculators_model_type": "mtp", "transformer_layer_config": layer},
                                            config, "h"), target, seed=3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        mtp.input_proj.weight.zero_()
        mtp.input_proj.weight[:, :32].copy_(torch.eye(32))
        mtp.layers[0].o.weight.zero_()
        mtp.layers[0].down.weight.zero_()
        mtp.token_norm.weight.copy_(1.0 + 0.4 * torch.randn(32, generator=gen))
        mtp.final_norm.weight.copy_(target.final_norm.weight)
    save_head(mtp, root / "mtp-head", verifier=str(root / "target"))
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return root


@pytest.fixture(scope="module")
def measured(head_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("head-measured") / "profile.json"
    calibrate(request(head_pair, out, draft=str(head_pair / "eagle3-head"), context_lens=(16, 32)))
    return load_profile(out)


def test_a_heads_profile_times_the_passes_it_makes_and_names_the_drafter(measured):
    profile = measured
    assert profile.draft.drafter == "eagle3" and profile.draft.draft_vocab_size == 200 and profile.draft.layers == 1
    assert profile.draft.is_head and not profile.target.is_head
    # one token drafting, k + 1 = 1..3 over the verified positions; a tree's levels and its verify: the wide widths
    assert profile.grid.draft_new_tokens == (1, 2, 3, 4, 8, 16, 32, 64)
    assert profile.grid.target_new_tokens == (1, 2, 3, 16, 32, 64)
    draft_rows = {(r.batch_size, r.new_tokens) for r in profile.timings if r.model == "draft"}
    assert draft_rows == {(b, n) for b in (1, 2) for n in profile.grid.draft_new_tokens}  # b <= 4: wide ones too
    greedy = next(entry for entry in profile.acceptance if entry.mode == "greedy")
    assert greedy.rank_acceptance is not None and len(greedy.rank_acceptance) == 2  # max_k depths
    assert [r for r in profile.overheads if r.tree_nodes is not None]  # trees grown from it, their overheads
    assert profile.insitu_steps
    # inside real steps the head made passes of one token and of k + 1 over the verified positions
    assert {(r.model, r.new_tokens) for r in profile.insitu_timings if r.model == "draft"} >= {("draft", 1),
                                                                                             ("draft", 3)}


def test_a_heads_acceptance_is_measured_by_drafting(head_pair):
    """The MTP head is right most of the time: measured by drafting chains of max_k, as the runtime drafts."""
    from specbatch.calibrate.acceptance import drafted_acceptance, read_prompts
    from specbatch.runtime.checkpoint import load_checkpoint
    from specbatch.runtime.heads import load_head
    from specbatch.runtime.sampling import Sampling

    loaded = load_checkpoint(head_pair / "target")
    head = load_head(head_pair / "mtp-head", loaded.model)
    prompts = [loaded.tokenizer.encode(text) for text in read_prompts(head_pair / "prompts.jsonl")]
    entry = drafted_acceptance(loaded.model, head, prompts, Sampling(), 3, 24, loaded.eos_token_ids)
    assert entry.mode == "greedy" and entry.source == "measured" and len(entry.per_position) == 3
    assert entry.trials[0] >= entry.trials[1] >= entry.trials[2] > 0  # position i + 1 only after i was accepted
    assert 0.2 < entry.per_position[0] < 1.0  # accepted and rejected both
    for i in range(2):  # position i + 2 is tried exactly when position i + 1 was accepted
        assert entry.trials[i + 1] == round(entry.per_position[i] * entry.trials[i])
    assert entry.rank_sequences is None  # a head's ranks depend on where a step starts: no per-position replay
    ranks = entry.rank_acceptance
    assert len(ranks) == 3 and all(len(row) == 4 and sum(row) <= 1 + 1e-9 for row in ranks)
    assert 0.2 < ranks[0][0] < 1.0 and sum(ranks[0][1:]) > 0  # lower-ranked children catch some misses


def test_a_heads_step_ranks_equal_the_head_recomputed_from_scratch(head_pair):
    """Rank of the target's token at every depth of a step starting at every position, against the head run on a
    fresh cache per start along the target's tokens (the path a drafted tree accepts)."""
    from specbatch.calibrate.acceptance import RANKS, head_step_ranks, target_continuations
    from specbatch.runtime.checkpoint import load_checkpoint
    from specbatch.runtime.heads import load_head
    from specbatch.runtime.sampling import Sampling

    loaded = load_checkpoint(head_pair / "target")
    target = loaded.model
    head = load_head(head_pair / "mtp-head", target)
    prompt = loaded.tokenizer.encode(PROMPTS[0])
    sequence = prompt + target_continuations(target, [prompt], 12, Sampling(), (), 0)[0]
    got = head_step_ranks(target, head, sequence, len(prompt), 3)
    features = head.head_config.feature_layers
    with torch.no_grad():
        for t, committed in enumerate(range(len(prompt), len(sequence))):
            tokens = torch.tensor([sequence[:committed]])
            _, taken = target(tokens[:, :-1], None, features=features)
            cache = head.new_cache(1, len(sequence) + 4)
            logits, outputs = head(tokens[:, 1:], taken, cache, last=1)
            hidden = outputs[:, -1:]
            for d in range(3):
                position = committed + d
                if position >= len(sequence):
                    assert got[t, d] == -1
                    continue
                order = logits[0, -1].argsort(descending=True, stable=True).tolist()
                assert got[t, d] == min(order.index(sequence[position]), RANKS), (t, d)
                logits, hidden = head(torch.tensor([[sequence[position]]]), hidden, cache, last=1, from_target=False)


def test_fit_and_table_of_a_head_rank_trees_and_name_the_drafter(measured):
    from specbatch.perfmodel.model import query_strategies

    fitted = fit_profile(measured)
    assert fitted.draft_info.drafter == "eagle3"
    table = compute_table(fitted, fitted.acceptance[0], 8, [24], strategies="all")
    assert table.drafter == "eagle3"
    ranked = query_strategies(fitted, fitted.acceptance[0], 1, 24).ranked
    assert {c.strategy.kind for c in ranked} >= {"none", "chain", "tree"}  # trees are candidates for a head


def test_the_second_stage_with_a_head_is_refused_in_one_line(head_pair, tmp_path):
    with pytest.raises(CalibrationError, match="the second stage speeds up a draft model's trees") as caught:
        calibrate(request(head_pair, tmp_path / "p.json", draft=str(head_pair / "eagle3-head"),
                          stage2=head_pair / "prompts.jsonl"))
    assert "\n" not in str(caught.value)


def test_with_a_head_the_target_is_timed_returning_the_states_the_head_reads(head_pair):
    """The runtime's verify pass copies out the hidden states a head reads: calibration times it so."""
    from specbatch.calibrate.benchmarks import ForwardTimer
    from specbatch.calibrate.grid import TimingPoint, make_grid
    from specbatch.calibrate.timing import RepetitionRule
    from specbatch.runtime.checkpoint import load_checkpoint
    from specbatch.runtime.heads import load_head

    target = load_checkpoint(head_pair / "target").model
    head = load_head(head_pair / "eagle3-head", target)
    seen = []
    original = type(target).forward

    def watched(self, *args, **kwargs):
        seen.append(kwargs.get("features"))
        return original(self, *args, **kwargs)

    type(target).forward = watched
    try:
        timer = ForwardTimer({"target": target, "draft": head}, make_grid((1,), (8,), 2, head=True), "cpu",
                             RepetitionRule(warmup_reps=0, min_reps=2, budget_s=0.0))
        timer.measure(TimingPoint("target", 1, 3, 8))
    finally:
        type(target).forward = original
    assert seen and all(features == (0, 1, 3) for features in seen)
