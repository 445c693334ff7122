"""The performance model: pure numpy / scipy / scikit-learn, never torch.

errors.py      SpecbatchError, the one base of every library error, and its subclasses
jsonio.py      the one atomic writer, schema-checked JSON reads, file sha256
fields.py      strict readers of JSON fields, each error naming the file and the field
profile/       the specbatch.profile/1 contract (what calibrate measured; engines, vidur composition, noise)
latency.py     T(b, n, L) per role: a roofline and a monotone data-driven refinement, cross-validated
staircase.py   the roofline plus the kernel steps found in the data (roofline+staircase)
token_curve.py a draft with the target's GEMM widths continued past its own token counts along the target's fit
kernel_notes.py what table and query say when a choice sits just past a kernel step
engine_steps.py an engine's step model fitted from its own steps (calibrate --engine vllm)
steps.py       which timing source predicts the measured steps best (the step stage of fit)
explain.py     why one prediction misses, term by term
uncertainty.py acceptance's confidence interval and ties between choices
fit.py         one pipeline from a profile to a FittedModel
acceptance.py  E(k) from per-position acceptance, the constant-alpha fit, what-if overrides
tree.py        draft trees as rank paths, their buffers and expected tokens; Strategy (what a step runs)
schedule.py    a step's forward passes as the runtime schedules them: chains, trees, the n-gram second stage
overhead.py    the step overhead outside forward passes, from the profile's measured rows
strategy.py    goodput of every strategy (none, chains, trees, each +/- second stage), the best one: the one
               prediction path that tables, queries, plots and the bench use
model.py       the specbatch.model/1 file: fit a profile, save, load, compute a table
query.py       what `specbatch query` answers (QueryAnswer, its JSON), from a model or a table
table.py       the specbatch.table/1 contract the runtime reads (standard library + tree.py), exports
exports.py     the engine exports of a table per drafter: vLLM, TensorRT-LLM, SGLang (standard library)
plot.py        the explanatory figure (matplotlib, optional)

Nothing is imported here, so `import perfmodel.table` stays light for the runtime.
"""
