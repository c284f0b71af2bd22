"""Shared pytest fixtures."""

import os

import pytest
import torch

pytest.register_assert_rewrite("_runs")  # its shared asserts report their values as a test's own do

from _runs import save_fresh_policy  # noqa: E402

# Tests run on 2 cores: keep intra-op threads from oversubscribing when several processes run.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def default_init(tmp_path_factory):
    """A fresh policy of ``configs/default.yaml``'s shape (8 experts) as a Hugging Face folder with the
    built-in tokenizer (``_runs.save_fresh_policy``); one a test module."""
    return save_fresh_policy(tmp_path_factory.mktemp("default") / "policy")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n 4 --dist loadgroup``): the namespaced-cluster tests share host network
    state (address ranges, bridges), so they run one at a time on one worker."""
    for item in items:
        if "multinode" in item.path.parts:
            item.add_marker(pytest.mark.xdist_group("netns"))
