"""What `explain` prints, and the fidelity part of `bench`'s output: the prediction error term by term
(perfmodel.explain, as its JSON) and the table's paired regret with its bootstrap interval."""
from __future__ import annotations

from typing import Any


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


TREE_LEGEND = ("tree paths: each number is a draft token's rank among its siblings (0 = the draft's most likely "
               "token, 1 = its second); 0.1 is the second most likely token after the most likely one")


def strategy_text(description: str) -> str:
    """A strategy as a reader sees it: a tree's shape before its rank paths.

    >>> strategy_text("tree 0,1,0.0 (3 nodes) +ngram")
    'tree of 3 nodes, 2 deep, 2 wide (paths 0,1,0.0) +ngram'
    """
    import re

    match = re.fullmatch(r"tree (\S+) \((\d+) nodes\)(.*)", description)
    if not match:
        return description
    spec, nodes, rest = match.groups()
    if spec.endswith("..."):  # cut for width: the shape of what is shown would mislead
        return f"tree of {nodes} nodes (paths {spec}){rest}"
    from specbatch.perfmodel.tree import parse_tree

    tree = parse_tree(spec)
    widest = max(tree.depths.count(depth) for depth in set(tree.depths))
    return f"tree of {nodes} nodes, {tree.depth} deep, {widest} wide (paths {spec}){rest}"


def explanation_table(explained: dict[str, Any], title: str | None = None):
    """One row per term: passes per step, ms per pass and ms per step, predicted vs measured, and the
    term's push on the predicted goodput (mix and pass time apart)."""
    from rich.table import Table

    step = explained["step_ms"]
    rate = explained["tokens_per_s"]
    table = Table(title=title or (f"b={explained['batch_size']} {strategy_text(explained['strategy'])} (context "
                                  f"{explained['context_len']}, {explained['steps']} full-batch steps): predicted "
                                  f"{rate['predicted']:.1f} vs measured {rate['measured']:.1f} tokens/s, "
                                  f"{_pct(explained['error'])}"))
    for header in ("term", "passes/step pred | meas", "ms/pass pred | meas", "ms/step pred | meas",
                   "effect: mix", "effect: time"):
        table.add_column(header, justify="right")
    measured_step = step["measured"]
    for term in explained["terms"]:
        is_pass = term["role"] is not None
        experts = term.get("experts_touched")  # a mixture of experts: the expert term of the pass
        table.add_row(term["name"] + ("" if experts is None else f" ({experts:.1f} experts/layer)"),
                      f"{_count(term['predicted_count'])} | {_count(term['measured_count'])}" if is_pass else "",
                      f"{_ms(term['predicted_pass_ms'])} | {_ms(term['measured_pass_ms'])}" if is_pass else "",
                      f"{_ms(term['predicted_ms'])} | {_ms(term['measured_ms'])}",
                      _pct(-term["mix_ms"] / measured_step) if is_pass else "",
                      _pct(-term["time_ms"] / measured_step))
    tokens = explained["tokens_per_step"]
    table.add_row("step", "", "", f"{_ms(step['predicted'])} | {_ms(step['measured'])}", "",
                  _pct(1 - step["predicted"] / measured_step))
    drawn = tokens.get("measured_drawn")
    if drawn is None:  # a bench.json from before the drawn tokens were kept
        table.add_row("tokens per step (per row)", "", "", f"{tokens['predicted']:.3f} | {tokens['measured']:.3f}", "",
                      _pct(tokens["predicted"] / tokens["measured"] - 1))
        return table
    half = tokens.get("drawn_halfwidth95")
    spread = f" ±{half:.3f}" if half is not None else ""
    table.add_row("tokens per step (per row)", "", "", f"{tokens['predicted']:.3f} | {drawn:.3f}{spread}", "",
                  _pct(tokens["predicted"] / drawn - 1))
    table.add_row("cut at max new tokens", "", "", f"{drawn:.3f} | {tokens['measured']:.3f}", "",
                  _pct(drawn / tokens["measured"] - 1))
    return table


def culprit_line(explained: dict[str, Any]) -> str:
    """The largest term; when that is tokens per step inside its sampling interval, says so (more steps
    would tell) and names the largest term after it."""
    culprit = explained["culprit"]
    line = (f"b={explained['batch_size']}: prediction {_pct(explained['error'])}; the largest term is "
            f"{culprit['term']} ({_pct(culprit['effect'])} on the predicted goodput)")
    tokens = explained["tokens_per_step"]
    if culprit["term"] == "tokens per step" and tokens.get("within_noise"):
        low, high = tokens["effect_ci95"]
        interval = f"[{_pct(low)}, {_pct(high) if high is not None else 'inf'}]"
        rest = [e for e in explained.get("effects", []) if e["term"] != "tokens per step"]
        after = f"; the next is {rest[0]['term']} ({_pct(rest[0]['effect'])})" if rest else ""
        line += (f", inside its 95 % sampling interval {interval} over {explained['steps']} steps: "
                 f"noise, not the model's E{after}")
    return line


def render_explanation(explained: dict[str, Any], notes: list[str]) -> None:
    from specbatch.console.output import note_line, report_console

    console = report_console()
    console.print(explanation_table(explained))
    console.print(culprit_line(explained), markup=False, highlight=False)
    console.print("effects: first-order push of the predicted goodput above the measured one; mix = how many "
                  "passes of that width ran, time = how long each took; the terms sum to both step times",
                  markup=False, highlight=False)
    for note in notes:
        console.print(note_line(note), markup=False, highlight=False)


def render_bench_fidelity(console, batches) -> None:
    """After bench's summary: the paired regret per batch size, then each batch size's decomposition."""
    from rich.table import Table

    regrets = [b for b in batches if b.paired_regret]
    if regrets:
        table = Table(title="table regret, paired per round (1 - geometric mean of table / k), bootstrap 95 %")
        goal = f"goal {100 * regrets[0].paired_regret['goal']:.0f} %"
        for header in ("b", "against", "rounds", "regret", "95 % interval", goal):
            table.add_column(header, justify="right")
        for batch in regrets:
            r = batch.paired_regret
            table.add_row(str(batch.batch_size), r["against"], str(r["rounds"]), f"{100 * r['regret']:.1f}%",
                          f"[{100 * r['ci95'][0]:.1f}%, {100 * r['ci95'][1]:.1f}%]",
                          r["verdict"] if r.get("settled", True) or r["verdict"] == "not resolved"
                          else f"{r['verdict']} (interval wider than ±{100 * r['goal']:.0f} %)")
        console.print(table)
    for batch in batches:
        if batch.explanation:
            console.print(explanation_table(batch.explanation))
            console.print(culprit_line(batch.explanation), markup=False, highlight=False)
