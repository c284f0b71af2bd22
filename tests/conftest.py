"""Shared pytest fixtures."""

import os

import pytest
import torch

# Tests run on 2 cores: keep intra-op threads from oversubscribing when several processes run.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
