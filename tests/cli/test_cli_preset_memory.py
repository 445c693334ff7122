"""A shape preset whose weights cannot fit is refused in one line before any weights are built: calibrate and bench
with what the weights need against what is free (calibrate.memory.weights_refusal), generate and serve because a
preset has no tokenizer to encode their text. The free memory is set to 24 GiB and building a model fails the test,
so none of them can pass by allocating and running out."""
from __future__ import annotations

import pytest

from cli_helpers import assert_one_line_error, invoke
from specbatch.calibrate.memory import GIB
from specbatch.runtime.model import CausalLM


@pytest.fixture
def small_machine(monkeypatch):
    """24 GiB free wherever calibrate and bench ask, and no model may be built."""
    free = lambda device: 24 * GIB  # noqa: E731
    monkeypatch.setattr("specbatch.calibrate.environment.available_memory_bytes", free)
    monkeypatch.setattr("specbatch.calibrate.run.available_memory_bytes", free)

    def refuse(*args, **kwargs):
        raise AssertionError("a model's weights were allocated")

    monkeypatch.setattr(CausalLM, "__init__", refuse)


@pytest.mark.parametrize("command, said", [
    (["calibrate", "--target", "qwen3-235b-a22b", "--draft", "qwen3-0.6b", "--acceptance", "0.8", "--dtype",
      "bfloat16"], ["--target qwen3-235b-a22b (437.9 GiB) and --draft qwen3-0.6b (1.1 GiB): the weights need 439.0 GiB "
                    "at 2 bytes a parameter, and 24.0 GiB are free on cpu", "on a GPU with more than 488 GiB free"]),
    (["bench", "--target", "mixtral-8x7b", "--draft", "llama-68m", "--synthetic-acceptance", "0.8", "--threads", "1"],
     ["--target mixtral-8x7b (174.0 GiB) and --draft llama-68m (0.3 GiB): the weights need 174.2 GiB at 4 bytes a "
      "parameter, and 24.0 GiB are free on cpu", "on a GPU with more than 97 GiB free"]),
], ids=["calibrate", "bench"])
def test_calibrate_and_bench_say_what_a_preset_needs_and_what_is_free_before_building_it(small_machine, tmp_path,
                                                                                          command, said):
    assert_one_line_error(invoke(*command, "--device", "cpu", "-o", tmp_path / "out"), *said)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["generate", "--prompt", "x", "--k", "0"], ["serve"]])
def test_generate_and_serve_refuse_a_preset_before_building_it(small_machine, command):
    assert_one_line_error(invoke(*command, "--target", "glm-4.5-air"), "--target glm-4.5-air: no tokenizer.json")
