"""Trees replayed on recorded greedy rank sequences: hand-computed steps, agreement with calibrate's
chain estimator, dependence between depths that the product formula misses, and the file round trips."""
from __future__ import annotations

import json

import numpy as np
import pytest

from specbatch.calibrate.acceptance import ScoredRow, rank_sequences, tokens_per_step
from specbatch.perfmodel.acceptance import AcceptanceModel, acceptance_from_profile
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.profile import profile_from_json
from specbatch.perfmodel.strategy import StepModel
from specbatch.perfmodel.tree import Strategy, chain, expected_tree_tokens, parse_tree, simulate_tree_steps
from perfmodel_fixtures import build_profile, roofline_latency


def test_replay_by_hand():
    tree = parse_tree("0,1,0.0")
    # steps: ranks [0, 0] accepted (a leaf) + the target's token; [] + token; [1] accepted (a leaf) + token
    assert simulate_tree_steps(tree, [[0, 0, 3, 2, 1, 0]]) == (2.0, 2 / 3)
    # a step is counted only when the tree's whole depth fits before the sequence ends
    assert simulate_tree_steps(tree, [[4, 0, 0], [0, 0]]) == (7 / 3, 2 / 3)  # [] + 4, [0, 0] + end; [0, 0]
    with pytest.raises(PerfModelError, match="depth"):
        simulate_tree_steps(tree, [[0]])


@pytest.mark.parametrize("k", [1, 3, 6])
def test_a_replayed_chain_is_calibrates_step_aligned_estimate(k):
    rng = np.random.default_rng(k)
    rows = []
    for length in (40, 17, 64):
        ranks = rng.choice(5, size=length, p=[0.7, 0.15, 0.05, 0.05, 0.05])  # 4 = "4 or worse"
        one_hot = np.eye(5)[ranks][:, :4]
        rows.append(ScoredRow(agreement=(ranks == 0).astype(float), ranks=one_hot, draft_top=None,
                              contexts=np.zeros((length, 2))))
    sequences = rank_sequences(rows)
    assert [list(s) for s in sequences] == [list(map(int, np.argmax(np.eye(5)[r], 1))) for r in
                                            [np.array(s) for s in sequences]]
    expected = tokens_per_step([row.agreement for row in rows], k)[k]
    assert simulate_tree_steps(chain(k), sequences)[0] == pytest.approx(expected, rel=1e-12)


def test_replay_sees_what_independent_depths_miss():
    """After a rank-1 token the next one is never the draft's top token, after a rank-0 one it is: per
    depth, rank 0 at depth 2 is accepted half the time, so the product formula credits node 1.0 with
    0.5 * 0.5; the replay never accepts it."""
    sequences = [[1, 3, 0, 0, 4] * 8]
    tree = parse_tree("0,1,1.0")
    per_depth = [[0.5, 0.5, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]]  # depth 1: ranks 1 and 0; depth 2: 3 and 0
    assert expected_tree_tokens(tree, per_depth) > simulate_tree_steps(tree, sequences)[0]
    model = AcceptanceModel.from_json({**_acceptance_json(), "rank_acceptance": per_depth,
                                       "rank_sequences": sequences}, "test")
    step = StepModel(lambda role, b, n, L: 1.0, _overhead(), model)
    assert step.tokens_per_step(Strategy(tree)) == simulate_tree_steps(tree, sequences)[0]
    assert step.leaf_end_probability(Strategy(tree)) == simulate_tree_steps(tree, sequences)[1]


def test_profile_and_model_files_carry_the_sequences():
    profile = build_profile(roofline_latency(), acceptance=[0.8, 0.7], batch_sizes=(1, 2), context_lens=(128,),
                            max_k=2)
    profile["acceptance"][0]["rank_sequences"] = [[0, 1, 4], [2]]
    entry = profile_from_json(json.loads(json.dumps(profile))).acceptance[0]
    assert entry.rank_sequences == ((0, 1, 4), (2,))
    model = acceptance_from_profile(entry)
    assert AcceptanceModel.from_json(model.to_json(), "test").rank_sequences == ((0, 1, 4), (2,))
    profile["acceptance"][0]["rank_sequences"] = [[0, -1]]
    with pytest.raises(PerfModelError, match=r"rank_sequences\[0\]"):
        profile_from_json(profile)


def _acceptance_json() -> dict:
    return {"source": "test", "mode": "greedy", "temperature": None, "per_position": [0.5, 0.5],
            "constant_alpha": 0.5, "constant_alpha_rmse": 0.0, "constant_alpha_r_squared": None}


def _overhead():
    from specbatch.perfmodel.overhead import OverheadModel

    return OverheadModel(())
