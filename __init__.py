"""specbatch: the best speculation length for every batch size, measured, modelled, tabulated and run.

The installed package maps the repository's top level: `specbatch.perfmodel` is `perfmodel/`,
`specbatch.cli` is `cli.py`, and the bundled demo pair and prompts are `specbatch/data/`.
"""
__version__ = "0.1.0"
