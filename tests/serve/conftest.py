"""This folder's tests run torch: the tiny-model fixtures."""
from torch_fixtures import *  # noqa: F401,F403 - fixtures are found by name
