"""``RayRollouts.evaluate_version``: a worker lost during a held-out eval, the eval goes to another worker."""

from types import SimpleNamespace

import pytest
import ray

from moerl.runtime.ray.rollouts import EVAL_ATTEMPTS, RayRollouts
from moerl.tasks.eval import EvalResult

RESULT = EvalResult(
    accuracy=0.25, mean_reward=0.5, num_prompts=4, mean_response_tokens=3.0, num_reward_errors=0
)


class _Worker:
    """A stand-in actor handle whose ``evaluate.remote`` returns what ``ray.get`` (patched) resolves."""

    def __init__(self, name: str, outcome):
        self.evaluate = SimpleNamespace(remote=lambda prompts, version, timeout_s: (name, outcome, version))


def _rollouts(outcomes: dict, active: list[str]) -> tuple[RayRollouts, list]:
    calls: list = []
    r = object.__new__(RayRollouts)  # no Ray instance: the fleet's parts are stand-ins
    r.backend = SimpleNamespace(handles={w: _Worker(w, o) for w, o in outcomes.items()})
    r.manager = SimpleNamespace(active_ids=lambda: [w for w in active if w in r.backend.handles])
    r.check_fleet = lambda force=False: calls.append("check")
    return r, calls


@pytest.fixture
def fake_get(monkeypatch):
    asked = []

    def get(ref):
        name, outcome, version = ref
        asked.append((name, version))
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(ray, "get", get)
    return asked


def test_a_worker_lost_during_the_eval_hands_it_to_the_next(fake_get):
    lost = ray.exceptions.RayActorError()
    r, calls = _rollouts({"w0": lost, "w1": RESULT}, ["w0", "w1"])
    assert r.evaluate_version(["p"], 3) is RESULT
    assert fake_get == [("w0", 3), ("w1", 3)] and calls.count("check") == 2  # the fleet checked each time


def test_every_try_failing_fails_the_eval_with_each_error(fake_get):
    lost = ray.exceptions.RayActorError()
    r, _ = _rollouts({"w0": lost}, ["w0"])
    with pytest.raises(RuntimeError, match=rf"held-out eval of v2 failed on {EVAL_ATTEMPTS} tries: w0: "):
        r.evaluate_version(["p"], 2)
    assert fake_get == [("w0", 2)] * EVAL_ATTEMPTS
    r, _ = _rollouts({}, [])
    with pytest.raises(RuntimeError, match="no rollout worker is left"):
        r.evaluate_version(["p"], 2)
