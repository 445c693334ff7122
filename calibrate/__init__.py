"""Calibration: measure this device for one target/draft pair and write a `specbatch.profile/1`.

    run.py          calibrate(CalibrationRequest) -> CalibrationSummary: the whole run, resumable
    grid.py         which passes are timed: target n = 1..max_k+1, draft n = 1, 2, per (b, L); wider
                    ones (trees) at small b; which step overheads (chains, trees)
    timing.py       the repetition rule (warm-up, median to ±3% at 95%, or the point's budget)
    benchmarks.py   timing one forward pass on the runtime's KV cache; a step's overhead
    acceptance.py   acceptance per draft position (and per depth and rank, for trees) from real weights
    stage2.py       the n-gram second stage: compatibility, guess accuracy, query cost
    models.py       the two models' profile entries; the memory check (loading is runtime.loading's)
    store.py        the profile and its CSV on disk, written after every point
    environment.py  the device: name, memory, metadata

Nothing is imported here, so `calibrate.grid` stays free of torch.
"""
