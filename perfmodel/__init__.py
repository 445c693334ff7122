"""The performance model: pure numpy / scipy / scikit-learn, never torch.

profile.py     the specbatch.profile/1 contract (what calibrate measured)
latency.py     T(b, n, L) per role: a roofline and a monotone data-driven refinement, cross-validated
acceptance.py  E(k) from per-position acceptance, the constant-alpha fit, what-if overrides
goodput.py     step time as the runtime schedules it, goodput, the best k per batch size
tree.py        draft trees as rank paths, their buffers and expected tokens; Strategy (what a step runs)
schedule.py    tree steps and the n-gram second stage's rounds as the runtime schedules them
strategy.py    goodput of every strategy (none, chains, trees, each +/- second stage), the best one
model.py       the specbatch.model/1 file: fit a profile, save, load, compute a table
table.py       the specbatch.table/1 contract the runtime reads (standard library + tree.py), exports
plot.py        the explanatory figure (matplotlib, optional)

Nothing is imported here, so `import perfmodel.table` stays light for the runtime.
"""
