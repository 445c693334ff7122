"""The contenders of a bench run: their stable names and the runtime policy behind each.

The names, as bench.json and bench.csv write them:
  * `k=K`: a chain of K draft tokens every step (`k=0` is plain decoding, always run);
  * `table`: the strategy of the --table file at the current batch size;
  * `adaptive`: runtime.adaptive.AdaptivePolicy from the --adaptive model file (its k changes step by step);
  * `tree:SPEC`: the same draft tree every step (`tree:chain:K` for a chain given as a tree; a long
    spec is cut at whole paths and ends in ',...(N nodes)'); `--tree auto` becomes, before anything is
    measured, the performance model's best tree at batch size 1 (a note says which);
  * with an n-gram second stage: `k=K+ngram` for every K > 0 and `tree:SPEC+ngram` for every tree;
  * peers: `hf-greedy` (transformers generate) and `hf-assisted` (its assisted generation, b = 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from specbatch.perfmodel.tree import Strategy, Tree, chain, parse_tree  # noqa: F401 - parse_tree: the doctests
from specbatch.runtime.policy import FixedK, FixedStrategy

TABLE_POLICY = "table"
ADAPTIVE_POLICY = "adaptive"
HF_GREEDY = "hf-greedy"
HF_ASSISTED = "hf-assisted"
TREE_PREFIX = "tree:"
STAGED_SUFFIX = "+ngram"  # the n-gram second stage speeds up the draft's own drafting
TREE_NAME_SPEC_CHARS = 40  # longer tree specs are cut at whole paths in policy names


def fixed_policy_name(k: int, staged: bool = False) -> str:
    return f"k={k}" + (STAGED_SUFFIX if staged else "")


def tree_label(tree: Tree, max_spec_chars: int = TREE_NAME_SPEC_CHARS) -> str:
    """`chain:K` for a chain, else the spec, cut at whole paths (as Strategy.describe cuts) when long.

    >>> tree_label(parse_tree("0,1,0.0")), tree_label(chain(3))
    ('0,1,0.0', 'chain:3')
    >>> tree_label(parse_tree("0,1,2,0.0,0.1,1.0"), max_spec_chars=8)
    '0,1,2,...(6 nodes)'
    """
    if tree.is_chain:
        return f"chain:{tree.depth}"
    spec = tree.spec()
    if len(spec) <= max_spec_chars:
        return spec
    cut = spec[:max_spec_chars + 1].rfind(",")  # keep whole paths only
    return (spec[:cut] + "," if cut > 0 else "") + f"...({tree.num_nodes} nodes)"


def tree_policy_name(tree: Tree, staged: bool = False) -> str:
    return TREE_PREFIX + tree_label(tree) + (STAGED_SUFFIX if staged else "")


def policy_family(name: str) -> str:
    """What a policy name stands for: chain (k=K), tree, staged (+ngram), table, adaptive or peer.

    >>> [policy_family(n) for n in ("k=0", "k=2+ngram", "tree:0,1", "tree:0,1+ngram", "table", "hf-greedy")]
    ['chain', 'staged', 'tree', 'staged', 'table', 'peer']
    """
    if name == ADAPTIVE_POLICY:
        return "adaptive"
    if name.endswith(STAGED_SUFFIX):
        return "staged"
    if name.startswith(TREE_PREFIX):
        return "tree"
    if name.startswith("k=") and name[2:].isdigit():
        return "chain"
    return "table" if name == TABLE_POLICY else "peer"


@dataclass(frozen=True)
class BenchPolicy:
    """One of our contenders: the runtime policy the generator asks, and the strategy it always gives
    (None for the table, whose strategy depends on the batch size)."""

    name: str
    policy: Any  # runtime.policy.FixedK | FixedStrategy | TableK | runtime.adaptive.AdaptivePolicy
    strategy: Strategy | None


def bench_policies(fixed_ks: Sequence[int], table=None, trees: Sequence[Tree] = (),
                   stage2: bool = False, adaptive=None) -> dict[str, BenchPolicy]:
    """name -> contender, in run order: k=K (ascending), table, adaptive, tree:SPEC, then with a second stage
    k=K+ngram (K > 0) and tree:SPEC+ngram. Equal trees run once; names that a cut spec would make
    equal get ' #2', ' #3' ... so every name is unique.

    >>> list(bench_policies([0, 2], trees=[parse_tree("0,1")], stage2=True))
    ['k=0', 'k=2', 'tree:0,1', 'k=2+ngram', 'tree:0,1+ngram']
    """
    policies = {fixed_policy_name(k): BenchPolicy(fixed_policy_name(k), FixedK(k), Strategy.from_k(k))
                for k in fixed_ks}
    if table is not None:
        policies[TABLE_POLICY] = BenchPolicy(TABLE_POLICY, table, None)
    if adaptive is not None:
        policies[ADAPTIVE_POLICY] = BenchPolicy(ADAPTIVE_POLICY, adaptive, None)
    unique_trees = list(dict.fromkeys(trees))
    names: dict[Tree, str] = {}
    for tree in unique_trees:
        name = tree_policy_name(tree)
        suffix = 2
        while name in names.values() or name in policies:
            name, suffix = f"{tree_policy_name(tree)} #{suffix}", suffix + 1
        names[tree] = name
    staged: list[tuple[str, Strategy]] = []
    if stage2:
        staged = [(fixed_policy_name(k, staged=True), Strategy(chain(k), stage2=True)) for k in fixed_ks if k > 0]
        staged += [(names[tree] + STAGED_SUFFIX, Strategy(tree, stage2=True)) for tree in unique_trees]
    for name, strategy in [(names[tree], Strategy(tree)) for tree in unique_trees] + staged:
        policies[name] = BenchPolicy(name, FixedStrategy(strategy), strategy)
    return policies


def table_strategy(table, batch_size: int, context_len: int) -> Strategy:
    """The table's strategy at a batch size and context, as TableK looks it up (without its warnings)."""
    bucket = table.table.bucket_for(context_len)
    return bucket.entries[min(batch_size, bucket.max_batch) - 1].chosen()
