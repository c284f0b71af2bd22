"""Fixtures of the end-to-end tests: a tiny policy checkpoint and short run configs."""

import os
from pathlib import Path

import pytest
from _runs import run_config, save_fresh_policy, start_shared_ray

from moerl.config import load_config
from moerl.runtime.ray import start_local_ray

TINY_MODEL = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=16",
    "model.num_experts=4",
    "model.top_k=2",
    "model.moe_intermediate_size=32",
    "model.max_position_embeddings=64",
]


@pytest.fixture(scope="session")
def tiny_init(tmp_path_factory):
    """A fresh tiny MoE policy saved as a Hugging Face folder with the built-in tokenizer."""
    return save_fresh_policy(tmp_path_factory.mktemp("init") / "policy", load_config(None, TINY_MODEL).model)


@pytest.fixture(scope="module")
def local_ray(request):
    """One local Ray instance for the test module; its workers find ``e2e_rewards`` through PYTHONPATH,
    and the module itself travels by value (so do the actor classes it defines, e.g. a stand-in worker)."""
    import ray

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), old) if p)
    # a new local instance: never another xdist worker's cluster that happens to be running
    start_local_ray(num_cpus=6, include_dashboard=False, configure_logging=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(request.module)
    yield
    ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def shared_ray(request):
    """A local Ray instance as ``local_ray``'s, but one for the consecutive modules of an xdist group
    (``pytestmark = pytest.mark.ray_group(name)``: tests/conftest.py puts them in one group): started by
    the first module that asks, left up for the next, shut down before the first test that does not use
    this fixture and at the session's end (``_runs.start_shared_ray``). A test using it never calls
    ``ray.shutdown()``."""
    start_shared_ray(request.module, Path(__file__).parent)


def short_config(tmp_path, init, *overrides):
    """A run config of a few small sync steps from ``init`` (overrides win)."""
    return run_config(
        None,
        tmp_path,
        init,
        *TINY_MODEL,
        "runtime.mode=sync",
        "trainer.steps=3",
        "trainer.batch_groups=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=4",
        "rollout.max_slots=8",
        "rollout.kv_token_budget=512",
        "task.num_eval=16",
        "eval.every=0",
        "trainer.checkpoint_every=0",
        *overrides,
    )
