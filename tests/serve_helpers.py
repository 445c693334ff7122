"""Shared by the serve tests: a demo-pair server on a free loopback port, and solo greedy references."""
from __future__ import annotations

import contextlib

import torch

from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK


@contextlib.contextmanager
def demo_server(**options):
    """The bundled demo pair behind the real HTTP stack, in this process, on one torch thread."""
    from specbatch.serve.app import create_app
    from specbatch.serve.server import BackgroundServer, ServeOptions, build

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serve_options = ServeOptions(**{"k": 3, "max_batch_size": 4, **options})
        runner, served = build(serve_options)
        with BackgroundServer(create_app(runner, served), drain_s=serve_options.drain_s) as server:
            server.runner, server.served = runner, served
            yield server
    finally:
        torch.set_num_threads(threads)


def solo_greedy_ids(runner, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The target alone, greedy, one prompt: what every greedy completion must equal."""
    engine = runner.engine
    generator = SpeculativeGenerator(engine.generator.target, None, engine.generator.eos_token_ids)
    return generator.generate([list(prompt_ids)], max_tokens, FixedK(0)).token_ids[0]
