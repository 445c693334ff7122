"""The terminal face of specbatch: rich tables and progress bars for each command.

Library functions return dataclasses; only these modules (and `cli.py`, which calls them) print.

    generation.py   generate: texts, step statistics, acceptance per position
    calibration.py  calibrate: progress while measuring, the passes and acceptance measured
    bench.py        bench: progress, measured vs predicted tokens/s, chain vs tree vs staged
    model.py        fit, table, query: parameters and errors, the table's runs, one point's trade-off
    demo.py         demo: the whole loop on the bundled pair, one rule per stage
    options.py      option types shared by every command, their parsing, the one-line error wrapper
"""
