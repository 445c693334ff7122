"""The draft's passes past its own token counts, read from the target's fit when both run the same GEMMs
(perfmodel/token_curve.py): the ratio of GEMM work from the shapes, the steps a draft's rows cannot show, and
the model file."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specbatch.perfmodel import latency as lat
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.fit import fit_profile
from specbatch.perfmodel.model import model_from_json, model_to_json
from specbatch.perfmodel.profile import ModelInfo, profile_from_json
from specbatch.perfmodel.token_curve import gemm_work_ratio, share_token_curve
from perfmodel_fixtures import build_profile

HIDDEN, INTERMEDIATE, VOCAB = 4096, 11008, 32000  # Llama-2-7B
BLOCK = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN  # q, k, v, o; gate, up, down; two norms
REST = 2 * VOCAB * HIDDEN + HIDDEN  # embedding, untied LM head, final norm


def llama(layers: int, hidden: int = HIDDEN) -> dict:
    block = 4 * hidden * hidden + 3 * hidden * INTERMEDIATE + 2 * hidden
    parameters = layers * block + 2 * VOCAB * hidden + hidden
    return {"source": f"llama-{layers}", "model_type": "llama", "random_weights": True, "parameters": parameters,
            "layers": layers, "hidden_size": hidden, "heads": 32, "kv_heads": 32, "head_dim": hidden // 32,
            "intermediate_size": INTERMEDIATE, "vocab_size": VOCAB, "weight_bytes": 2 * parameters,
            "kv_bytes_per_token": 2 * layers * hidden * 2, "max_position_embeddings": 4096}


MODELS = {"target": llama(32), "draft": llama(1)}  # Llama-2-7B and one layer of it with its head (EAGLE-sized)


def test_the_gemm_work_ratio_is_the_shapes():
    assert BLOCK == 202_383_360 and MODELS["target"]["parameters"] == 6_738_415_616  # Llama-2-7B's own count
    target, draft = ModelInfo(**MODELS["target"]), ModelInfo(**MODELS["draft"])
    # one block and the head over 32 blocks and the head (the embedding is a lookup, not a GEMM)
    assert gemm_work_ratio(target, draft) == pytest.approx((202_383_360 + 131_072_000) / (32 * 202_383_360
                                                                                         + 131_072_000), rel=1e-12)
    assert gemm_work_ratio(target, target) == 1.0
    assert gemm_work_ratio(target, ModelInfo(**llama(1, hidden=2048))) is None  # other widths, other kernels


# A device whose GEMMs read their weights or compute over whole tiles of 16 token rows, whichever takes longer
# (at the same token count for the same widths), and step right after 16 (down: a faster kernel) and 128 token
# rows, by amounts in proportion to each model's GEMM work (its GEMM weights); plus attention and a per-row
# cost per layer. The draft's rows (b <= 32, n <= 2) see the first step only.
STEPS_MS_PER_WEIGHT = {16: -2e-10, 128: 8e-10}
STEP_AFTER = 128


def device_ms(role: str, b, n, L):
    info = MODELS[role]
    b, n, L = (np.asarray(v, dtype=float) for v in (b, n, L))
    work = info["layers"] * BLOCK + VOCAB * HIDDEN
    tokens = b * n
    tiles = np.ceil(tokens / 16) * 16
    gemm_ms = np.maximum(2.0 * work / 1.6e9, 2.0 * work * tiles / 2e11)  # fp16 weights at 1.6 TB/s, 200 TFLOP/s
    for after, per_weight in STEPS_MS_PER_WEIGHT.items():
        gemm_ms = gemm_ms + per_weight * work * (tokens > after)
    return 0.05 + gemm_ms + info["layers"] * (1.5e-6 * b * (L + n) + 1e-3 * b)


def grid_points(role: str, widths, seed: int) -> lat.Points:
    b, n, L = (g.reshape(-1).astype(float) for g in np.meshgrid([1, 2, 4, 8, 16, 32], widths, [256, 1024],
                                                                 indexing="ij"))
    noise = np.exp(0.005 * np.random.default_rng(seed).standard_normal(len(b)))
    return lat.Points(b, n, L, device_ms(role, b, n, L) * noise)


@pytest.fixture(scope="module")
def fits():
    shapes = {role: lat.RoleShape.from_model_info(ModelInfo(**info)) for role, info in MODELS.items()}
    target = lat.fit_latency_model(shapes["target"], grid_points("target", range(1, 10), 0), lat.STAIRCASE)
    draft = lat.fit_latency_model(shapes["draft"], grid_points("draft", (1, 2), 1), lat.STAIRCASE)
    return target, draft


def test_past_its_rows_the_draft_steps_where_the_target_measured_the_step(fits):
    target, alone = fits
    shared = share_token_curve(alone, ModelInfo(**MODELS["draft"]), target, ModelInfo(**MODELS["target"]))
    assert shared.token_curve is not None and shared.token_curve.batch_size == 32
    assert shared.token_curve.context_len == 256
    # b = 32 rows of 2 tokens reach 64: the draft's own rows never cross the step after 128 tokens
    b = np.array([48.0, 64.0, 65.0, 80.0, 128.0])
    truth = device_ms("draft", b, 2.0, 256.0)
    step_share = STEPS_MS_PER_WEIGHT[STEP_AFTER] * (BLOCK + VOCAB * HIDDEN) / truth[-1]
    assert step_share > 0.15
    with_curve = np.abs(shared.latency_ms(b, 2.0, 256.0) / truth - 1)
    assert np.all(with_curve < 0.03)
    own = np.abs(alone.latency_ms(b, 2.0, 256.0) / truth - 1)
    assert np.all(own[b * 2 > STEP_AFTER] > 0.05) and own.max() > 0.1  # its own rows alone miss the step
    # inside its measured box the draft's own fit stands
    assert shared.latency_ms(16.0, 2.0, 1024.0) == pytest.approx(alone.latency_ms(16.0, 2.0, 1024.0), rel=1e-12)


def test_no_curve_for_a_draft_of_other_widths_or_a_source_that_reaches_no_further(fits):
    target, draft = fits
    other = ModelInfo(**llama(1, hidden=2048))
    assert share_token_curve(draft, other, target, ModelInfo(**MODELS["target"])) is draft
    narrow = replace(target, box=lat.Box((1.0, 32.0), (1.0, 2.0), (256.0, 1024.0)))  # 64 tokens, as the draft's
    assert share_token_curve(draft, ModelInfo(**MODELS["draft"]), narrow, ModelInfo(**MODELS["target"])) is draft


def test_fit_lends_the_curve_and_the_model_file_keeps_it():
    profile = profile_from_json(build_profile(lambda role, b, n, L: float(device_ms(role, b, n, L)), models=MODELS,
                                              batch_sizes=(1, 2, 4, 8, 16, 32), context_lens=(256, 1024), max_k=8,
                                              noise=0.005, seed=3))
    fitted = fit_profile(profile)
    draft = fitted.roles["draft"].model
    assert draft.kind == lat.STAIRCASE and draft.token_curve is not None
    assert draft.token_curve.source is fitted.roles["target"].model
    b = np.array([48.0, 65.0, 80.0, 128.0])
    assert np.all(np.abs(draft.latency_ms(b, 2.0, 256.0) / device_ms("draft", b, 2.0, 256.0) - 1) < 0.03)
    written = model_to_json(fitted)
    assert written["roles"]["draft"]["token_curve"] == {"from_role": "target", "scale": pytest.approx(
        gemm_work_ratio(profile.target, profile.draft), rel=1e-11), "batch_size": 32.0, "context_len": 256.0}
    again = model_from_json(written, "model.json")
    curve = again.roles["draft"].model.token_curve
    assert curve.source is again.roles["target"].model  # re-linked to the loaded target, not a copy
    tokens = np.arange(1.0, 300.0)
    assert np.allclose(curve.tokens_ms(tokens), draft.token_curve.tokens_ms(tokens), rtol=1e-6)
    written["roles"]["draft"]["token_curve"]["from_role"] = "draft"
    with pytest.raises(PerfModelError, match="token_curve"):
        model_from_json(written, "model.json")
