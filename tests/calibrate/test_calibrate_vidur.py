"""`calibrate --from-vidur`: passes composed from vidur's published A100 timings (tests/calibrate/fixtures/vidur),
checked against sums done by hand from the fixture's own rows."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specbatch.calibrate.errors import CalibrationError
from specbatch.calibrate.vidur import VidurRequest, compose_profile, read_vidur_folder
from specbatch.perfmodel.fit import fit_profile
from specbatch.perfmodel.profile import load_profile
from specbatch.runtime.presets import PRESETS
from cli_helpers import assert_one_line_error, invoke

A100 = Path(__file__).parent / "fixtures" / "vidur" / "a100" / "Llama-2-7b-hf"
LM_HEAD = 32000 / (2 * 11008)  # Llama-2-7B's vocabulary over the fused gate/up GEMM's output columns


@pytest.fixture(scope="module")
def draft_config(tmp_path_factory) -> Path:
    """Llama-2-7B's own block, one layer of it: the shape vidur timed, so the same folder composes it."""
    path = tmp_path_factory.mktemp("draft") / "config.json"
    path.write_text(json.dumps(dict(PRESETS["llama-2-7b"], num_hidden_layers=1)))
    return path


@pytest.fixture(scope="module")
def composed(draft_config):
    request = VidurRequest(A100, "llama-2-7b", str(draft_config), "0.8", Path("unused.json"),
                           batch_sizes=(1, 3, 17, 45), context_lens=(256, 1024, 2048), max_k=8)
    profile = compose_profile(request).profile
    return {(r.model, r.batch_size, r.new_tokens, r.context_len): r.median_ms for r in profile.timings}, profile


def test_a_decode_pass_is_the_hand_sum_of_the_fixture_rows(composed):
    rows, _ = composed
    # num_tokens = 1: input norm .005, QKV .065, rope .005, O .025, post norm .005, gate/up .116, act .007,
    # down .060, add .002; the untimed second add .002; decode attention at b = 1, L = 256: .012 + reshape .001
    per_layer = 0.005 + 0.065 + 0.005 + 0.025 + 0.005 + 0.116 + 0.007 + 0.060 + 0.002 + 0.002 + 0.013
    expected = 0.003 + 32 * per_layer + 0.005 + 0.116 * LM_HEAD  # + embedding, final norm, LM head
    assert rows[("target", 1, 1, 256)] == pytest.approx(expected, rel=1e-5)
    assert rows[("draft", 1, 1, 256)] == pytest.approx(0.003 + per_layer + 0.005 + 0.116 * LM_HEAD, rel=1e-5)


def test_an_unprofiled_token_count_reads_the_next_profiled_one(composed):
    rows, profile = composed
    # b = 3, n = 3: 9 tokens, not profiled: the 16-token row (.004 .064 .006 .026 .004 .111 .008 .062 .002, emb
    # .014); attention at b = 3, L = 256 (.016 + .001) scaled by the keys read, (256 + 3) / (256 + 1)
    per_layer = 0.004 + 0.064 + 0.006 + 0.026 + 0.004 + 0.111 + 0.008 + 0.062 + 0.002 + 0.002 + 0.017 * 259 / 257
    assert rows[("target", 3, 3, 256)] == pytest.approx(0.014 + 32 * per_layer + 0.004 + 0.111 * LM_HEAD, rel=1e-5)
    assert profile.composition.padded_rows > 0


def test_a_verify_pass_past_the_136_token_step(composed):
    rows, _ = composed
    # b = 17, n = 8: 136 tokens, profiled (the QKV GEMM has jumped from .0745 at 128 to .132); attention at
    # b = 17, L = 2048: .348 + .002, times (2048 + 8) / (2048 + 1)
    per_layer = (0.005 + 0.132 + 0.010 + 0.038 + 0.005 + 0.205 + 0.0125 + 0.139 + 0.003 + 0.003
                 + 0.350 * 2056 / 2049)
    assert rows[("target", 17, 8, 2048)] == pytest.approx(0.009 + 32 * per_layer + 0.005 + 0.205 * LM_HEAD, rel=1e-5)


def test_a_context_profiled_twice_takes_the_mean():
    timings = read_vidur_folder(A100)
    assert timings.attention_ms[1024][45] == pytest.approx((0.434 + 0.002 + 0.437 + 0.002) / 2)
    assert timings.shape == {"n_head": 32, "n_kv_head": 32, "n_embd": 4096, "n_expanded_embd": 11008,
                             "use_gated_mlp": True}


def test_the_profile_says_what_is_measured_estimated_and_left_out(composed):
    _, profile = composed
    composition = profile.composition
    assert composition.source == "vidur" and len(composition.files) == 2
    assert any("LM head" in line for line in composition.estimated)
    assert any("launch gaps" in line for line in composition.left_out)
    assert profile.device.dtype == "float16" and profile.acceptance[0].source == "user"
    assert profile.acceptance[0].per_position == (0.8,) * 8
    assert profile.grid.context_lens == (256, 1024, 2048)


def test_vidur_format_attention_file_is_read_too(tmp_path):
    """vidur's own attention.csv (every attention row): decode rows at tensor parallel 1 only, reshapes and
    the KV save added, blank cells (a part that did not run) as 0."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "mlp.csv").write_text((A100 / "mlp.csv").read_text())
    header = ("n_embd,n_q_head,n_kv_head,block_size,num_tensor_parallel_workers,batch_size,prefill_chunk_size,"
              "kv_cache_size,is_prefill,time_stats.attn_prefill.median,time_stats.attn_decode.median,"
              "time_stats.attn_kv_cache_save.median,time_stats.attn_output_reshape.median\n")
    (folder / "attention.csv").write_text(header + "4096,32,32,16,1,4,0,512,False,,0.036,0.004,0.001\n"
                                          "4096,32,32,16,2,4,0,512,False,,0.020,0.002,0.001\n"
                                          "4096,32,32,16,1,1,64,512,True,0.5,,0.01,0.001\n")
    timings = read_vidur_folder(folder)
    assert timings.attention_ms == {512: {4: pytest.approx(0.041)}}
    assert timings.attention_parts == ("attn_kv_cache_save", "attn_decode", "attn_output_reshape")


def test_fit_reads_the_imported_profile_and_finds_the_steps(tmp_path, draft_config):
    out = tmp_path / "profile.json"
    result = invoke("calibrate", "--from-vidur", A100, "--target", "llama-2-7b", "--draft", draft_config,
                    "--acceptance", "0.8", "--batch-sizes", ",".join(map(str, range(1, 41))), "--context-lens",
                    "512,2048", "-o", out)
    assert result.exit_code == 0, result.output
    assert "left out: kernel launch gaps" in result.output
    profile = load_profile(out)
    assert out.with_suffix(".csv").is_file()
    fitted = fit_profile(profile)
    target = fitted.roles["target"]
    assert target.kind == "roofline+staircase"
    # the QKV, O and MLP GEMMs all jump between 128 and 136 tokens: the biggest step found is right after 128
    steps = [s for s in target.model.staircase.steps if s.axis == "tokens"]
    assert max(steps, key=lambda s: s.coefficient).after == 128.0
    assert fitted.composition == profile.composition
    assert any("composed from vidur" in note for note in fitted.extrapolation_notes(40, [512], 8))


@pytest.mark.parametrize("args,fragments", [
    (("--quick",), ("--from-vidur times nothing", "--quick")),
    (("--context-lens", "300"), ("--context-lens [300]", "256")),
    (("--batch-sizes", "200"), ("--batch-sizes [200]",)),
])
def test_bad_input_is_one_line(tmp_path, draft_config, args, fragments):
    result = invoke("calibrate", "--from-vidur", A100, "--target", "llama-2-7b", "--draft", draft_config,
                    "--acceptance", "0.8", "-o", tmp_path / "p.json", *args)
    assert_one_line_error(result, *fragments)


def test_a_model_vidur_did_not_profile_is_refused(tmp_path):
    result = invoke("calibrate", "--from-vidur", A100, "--target", "llama-2-7b", "--draft", "llama-68m",
                    "--acceptance", "0.8", "-o", tmp_path / "p.json")
    assert_one_line_error(result, "--draft llama-68m", "n_embd 768 here, 4096 there", "--draft-from-vidur")
    with pytest.raises(CalibrationError, match="no mlp.csv"):
        read_vidur_folder(tmp_path)


def test_a_mixture_of_experts_of_the_profiled_widths_is_refused(tmp_path, draft_config):
    """Mixtral's block has Llama's widths; vidur's dense MLP, which reads every weight, would compose it silently."""
    moe = tmp_path / "mixtral.json"
    moe.write_text(json.dumps(dict(PRESETS["llama-2-7b"], model_type="mixtral", num_local_experts=8,
                                   num_experts_per_tok=2, num_hidden_layers=2)))
    result = invoke("calibrate", "--from-vidur", A100, "--target", moe, "--draft", draft_config,
                    "--acceptance", "0.8", "-o", tmp_path / "p.json")
    assert_one_line_error(result, f"--target {moe}", "a mixture of experts (8 experts, top-2)", "on a GPU")


def test_acceptance_is_required_and_an_existing_profile_is_kept(tmp_path, draft_config):
    out = tmp_path / "p.json"
    assert_one_line_error(invoke("calibrate", "--from-vidur", A100, "--target", "llama-2-7b", "--draft",
                                 draft_config, "-o", out), "--acceptance")
    out.write_text('{"schema": "specbatch.profile/1"}')
    assert_one_line_error(invoke("calibrate", "--from-vidur", A100, "--target", "llama-2-7b", "--draft",
                                 draft_config, "--acceptance", "0.8", "-o", out), "--force")
    assert out.read_text() == '{"schema": "specbatch.profile/1"}'


def test_the_device_is_named_after_vidur_s_gpu_folder(composed):
    _, profile = composed
    assert profile.device.name == "a100 (vidur's per-operation timings)"
    assert profile.device.kind == "cuda"
