"""The runtime tests: the tiny-model fixtures, on one torch thread."""
import pytest
import torch

from torch_fixtures import *  # noqa: F401,F403 - fixtures are found by name


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's spinning
    threads make each of their forward passes up to 100x slower: the runtime tests run on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["sdpa", "varlen"])
def backend(request, monkeypatch):
    """The CPU attention backend, and the CUDA varlen backend's code run through a CPU reference of the
    kernel (tests/runtime/varlen_reference.py); set it on a model as `model.attention_backend = backend`."""
    if request.param == "varlen":
        import varlen_reference

        varlen_reference.use_reference_flash(monkeypatch)
    return request.param

