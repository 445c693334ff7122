"""The step-op counter (bench.step_ops): it counts what would make a GPU wait, and a speculative step makes
the host wait once. Oracles: hand-written torch calls whose syncs are known, and the runtime's design (one
read-back per step, none in a forward pass)."""
from __future__ import annotations

import pytest
import torch

from specbatch.bench.step_ops import OpCounter, count_steps, counting, main
from specbatch.perfmodel.tree import Strategy, parse_tree
from specbatch.runtime.clock import DeviceClock
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK, FixedStrategy
from specbatch.runtime.sampling import Sampling


def test_a_reshape_that_copies_is_a_launch_and_one_that_views_is_not():
    """Under inference mode aten.reshape reaches the counter as one op tagged a view, copy or not."""
    with torch.inference_mode():
        x = torch.randn(2, 3, 4)
        with counting(OpCounter()) as counter:
            x.reshape(6, 4)  # contiguous: a view
            assert counter.counts["launches"] == 0
            x.transpose(1, 2).reshape(2, 12)  # strides that no view can have: a copy kernel
            assert counter.counts["launches"] == 1


def test_the_counter_sees_every_kind_of_host_read_and_no_more():
    x = torch.arange(6)
    with counting(OpCounter()) as counter:
        y = (x * 2 + 1).view(2, 3)  # two launches, a view
        assert counter.counts == {"syncs": 0, "launches": 2, "uploads": 0}
        int(y[0, 0]), bool(y.sum() > 3), y.tolist(), y.numpy()  # four reads: item, bool, tolist, numpy
        x[x > 2]  # a boolean index: the output's size is the data's
        x[torch.tensor([0, 1])]  # an index by positions: no read
        DeviceClock("cpu").now()  # a barrier on CUDA, whatever it does here
        DeviceClock("cpu").host_s()  # no barrier
    assert counter.counts["syncs"] == 6
    assert set(counter.sync_ops) == {"_local_scalar_dense", "tolist", "numpy", "index", "synchronize"}


@pytest.mark.parametrize("policy", [FixedK(0), FixedK(4), FixedStrategy(Strategy(parse_tree("0,1,2,0.0,0.1,1.0")))],
                         ids=["plain", "chain", "tree"])
def test_a_step_reads_the_device_back_once(policy, tiny_pair, prompts):
    """Every full-batch step, with the tree's bookkeeping as CUDA runs it: exactly one read-back (the
    issue's bound is 2 for a chain and 3 for a tree)."""
    generator = SpeculativeGenerator(tiny_pair.target, tiny_pair.draft, host_bookkeeping=False)
    steps = count_steps(generator, prompts[:6], policy, 8)
    assert len(steps) >= 3
    assert [step["syncs"] for step in steps] == [1] * len(steps)
    assert all(step["launches"] > 20 and step["uploads"] == 0 for step in steps)


def test_multinomial_counts_as_the_two_waits_it_makes_on_cuda():
    probs = torch.tensor([[0.25, 0.75]])
    with counting(OpCounter()) as counter:
        torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(0))
    assert counter.counts["syncs"] == 2 and counter.sync_ops == {"multinomial": 2}


@pytest.mark.parametrize("policy", [FixedK(4), FixedStrategy(Strategy(parse_tree("0,1,2,0.0,0.1,1.0")))],
                         ids=["chain", "tree"])
def test_a_sampled_step_reads_the_device_back_once(policy, tiny_pair, prompts):
    """A seeded torch.Generator draws every token (drafts, residuals, the bonus) on the device."""
    generator = SpeculativeGenerator(tiny_pair.target, tiny_pair.draft, host_bookkeeping=False)
    steps = count_steps(generator, prompts[:6], policy, 16, Sampling(temperature=1.0, top_p=0.9), seed=4)
    assert len(steps) >= 3
    assert [step["syncs"] for step in steps] == [1] * len(steps)


def test_a_staged_step_reads_back_once_per_draft_round(tiny_pair, prompts, ngram):
    """Staged drafting guesses on the device; what it reads is which slots to feed again, once per draft
    round (after each draft pass), then the step's own read-back."""
    from specbatch.bench.step_ops import StepCounts

    generator = SpeculativeGenerator(tiny_pair.target, tiny_pair.draft, host_bookkeeping=False, stage2=ngram)
    counter = OpCounter()
    observer = StepCounts(counter)
    records = []
    finished = observer.step_finished
    observer.step_finished = lambda record: (records.append(record), finished(record))
    with counting(counter):
        generator.generate(prompts[:6], 8, FixedStrategy(Strategy(parse_tree("0,1,0.0,0.0.0"), stage2=True)),
                           observer=observer)
    assert len(records) >= 3
    assert [counts["syncs"] for _, counts in observer.steps] == [r.draft_passes + 1 for r in records]


def test_the_command_prints_a_row_per_strategy_and_bookkeeping(capsys):
    main(["--batch-size", "2", "--steps", "3", "--k", "2", "--tree", "0,1,0.0"])
    rows = [line for line in capsys.readouterr().out.splitlines() if "as on" in line]
    assert len(rows) == 12
    assert all(line.split()[-3] == "1" for line in rows if "CUDA" in line and "ngram" not in line)
