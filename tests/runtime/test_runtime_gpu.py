"""The runtime on CUDA, against the same oracles as on the CPU: `transformers` logits and greedy generation
(float32), the exact distribution of a speculative sampling step on a tiny pair, and bfloat16 against
float32. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from specbatch.runtime.checkpoint import load_checkpoint
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK
from specbatch.runtime.sampling import Sampling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def hf_llama_dir(tmp_path_factory, randomize):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    hf = randomize(transformers.LlamaForCausalLM(config), seed=7)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # peaked: greedy never hinges on rounding
    directory = tmp_path_factory.mktemp("hf_llama")
    hf.save_pretrained(str(directory))
    return hf, directory


def test_logits_and_greedy_generation_match_transformers_on_cuda(hf_llama_dir, make_noisy_copy, prompts8):
    hf, directory = hf_llama_dir
    hf = hf.to("cuda").float()
    ours = load_checkpoint(directory, "cuda", torch.float32)
    tokens = torch.tensor([prompts8[4]], device="cuda")
    with torch.inference_mode():
        expected = hf(input_ids=tokens).logits
        found = ours.model(tokens)
    torch.testing.assert_close(found, expected, atol=1e-4, rtol=1e-4)
    draft = make_noisy_copy(ours.model.cpu(), num_layers=1, noise=0.3, seed=5).to("cuda")
    ours.model.to("cuda")
    prompts = [prompts8[i] for i in (1, 2, 4)]
    with torch.inference_mode():
        reference = [hf.generate(input_ids=torch.tensor([p], device="cuda"), do_sample=False, max_new_tokens=12,
                                 min_new_tokens=0, num_beams=1)[0, len(p):].tolist() for p in prompts]
    for k in (0, 3):
        result = SpeculativeGenerator(ours.model, draft if k else None, ours.eos_token_ids).generate(
            prompts, 12, FixedK(k))
        assert result.token_ids == reference


def test_a_speculative_sampling_step_draws_from_the_targets_distribution_on_cuda(llama_config_factory):
    """Two tokens per row from one prompt: the first from the prefill, the second through a k = 2 step
    (draft proposals, acceptance, residual). Given the first token, the second's empirical distribution over
    many rows must be the target's softmax (chi-square goodness of fit), whatever the draft proposes."""
    from scipy.stats import chisquare

    from specbatch.runtime.checkpoint import build_model

    config = llama_config_factory(vocab_size=8, max_position_embeddings=32)
    target = build_model(config, "cuda", torch.float32, seed=11)
    draft = build_model(config, "cuda", torch.float32, seed=12)
    prompt, rows = [3, 1, 4, 1, 5], 40_000
    result = SpeculativeGenerator(target, draft).generate([prompt] * rows, 2, FixedK(2), Sampling(temperature=1.0),
                                                          seed=7)
    pairs = torch.tensor(result.token_ids)  # (rows, 2)
    tested = 0
    for first in range(config.vocab_size):
        seconds = pairs[pairs[:, 0] == first, 1]
        if len(seconds) < 2000:
            continue
        with torch.inference_mode():
            p = torch.softmax(target(torch.tensor([prompt + [first]], device="cuda"))[0, -1].double(), -1).cpu()
        observed = torch.bincount(seconds, minlength=config.vocab_size).double()
        assert chisquare(observed.numpy(), (p * len(seconds)).numpy()).pvalue > 1e-4, (first, observed, p)
        tested += 1
    assert tested >= 2


def test_bfloat16_agrees_with_float32_on_cuda(hf_llama_dir, prompts8):
    """Peaked logits: bfloat16 logits within its rounding of float32's, and the same greedy tokens."""
    _, directory = hf_llama_dir
    exact = load_checkpoint(directory, "cuda", torch.float32).model
    half = load_checkpoint(directory, "cuda", torch.bfloat16).model
    tokens = torch.tensor([prompts8[4]], device="cuda")
    with torch.inference_mode():
        reference, found = exact(tokens), half(tokens).float()
    scale = reference.abs().max()
    assert (found - reference).abs().max() <= 0.05 * scale
    prompts = [prompts8[i] for i in (0, 2, 6)]
    expected = SpeculativeGenerator(exact, None).generate(prompts, 12, FixedK(0)).token_ids
    assert SpeculativeGenerator(half, None).generate(prompts, 12, FixedK(0)).token_ids == expected
    assert SpeculativeGenerator(half, half).generate(prompts, 12, FixedK(3)).token_ids == expected
