"""Contract of a reward (docs/extending.md "Reward"): a verifiable reward function given by
``task.reward_fn`` (``module:function``) and the reward-model mixing tables
(``moerl.rl.reward_mix.NORMALIZATIONS``, ``COMBINES``).

- A reward function (``REWARD_FUNCTIONS``: the shipped example and the tests' own, plus any new one)
  loads with ``load_score_fn`` (it takes ``(prompt_text, response_text, answer)``), and through a task it
  scores every response, garbage included, as a ``Reward`` whose score and info are floats; one that
  raises costs that sample (``Reward(0.0, {"error": 1.0, ...})``), never the run.
- A normalization maps a [G, N] score tensor to a finite [G, N] float32 one, a constant one included (no
  division by a zero spread); a combine maps (verifiable [G, N], normalized score [G, N], weights) to a
  finite [G, N] one that moves with the model's score when its weight is not 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moerl.config import load_config
from moerl.rl.reward_mix import COMBINES, NORMALIZATIONS
from moerl.tasks import Reward, make_task
from moerl.tasks.rewards import load_score_fn

ROOT = Path(__file__).resolve().parents[2]
REWARD_FUNCTIONS = {
    "my_reward:score": ROOT / "examples",  # examples/my_reward.py, the example users start from
    "dist_rewards:first_is_digit": ROOT / "tests" / "distributed",
    "e2e_rewards:first_is_digit": ROOT / "tests" / "e2e",
    "contract_rewards:raises": None,  # written by the test: a function that raises
}
"""``task.reward_fn`` -> the folder it imports from (``task.import_dirs``)."""
RESPONSES = ["", "42", "\x00 garbage ####", "9" * 300]


def _dirs(spec: str, tmp_path: Path) -> str:
    folder = REWARD_FUNCTIONS[spec]
    if folder is None:
        (tmp_path / "contract_rewards.py").write_text(
            "def raises(prompt, response, answer):\n    raise RuntimeError('x')\n"
        )
        folder = tmp_path
    return str(folder)


def check_reward_function_contract(spec: str, folder: str) -> None:
    """Assert the reward-function contract (module docstring) of ``spec`` importable from ``folder``."""
    load_score_fn(spec, dirs=[folder])
    cfg = load_config(
        None, ["task.name=arithmetic", f"task.reward_fn={spec}", f"task.import_dirs=[{folder}]"]
    )
    task = make_task(cfg.task)
    prompt = task.eval_prompts()[0]
    for response in RESPONSES:
        reward = task.reward(prompt.text, response, prompt.answer)
        assert isinstance(reward, Reward) and isinstance(reward.score, float), (
            f"{spec}: not a Reward: {reward}"
        )
        assert all(isinstance(v, float) for v in reward.info.values()), f"{spec}: info must be floats"


@pytest.mark.parametrize("spec", sorted(REWARD_FUNCTIONS))
def test_reward_function_meets_the_contract(spec, tmp_path):
    check_reward_function_contract(spec, _dirs(spec, tmp_path))


def test_a_raising_reward_function_costs_the_sample_only(tmp_path):
    spec = "contract_rewards:raises"
    cfg = load_config(
        None,
        ["task.name=arithmetic", f"task.reward_fn={spec}", f"task.import_dirs=[{_dirs(spec, tmp_path)}]"],
    )
    task = make_task(cfg.task)
    reward = task.reward("1+1=", "2", "2")
    assert reward.score == 0.0 and reward.info["error"] == 1.0


def test_a_reward_function_of_the_wrong_signature_is_refused(tmp_path):
    (tmp_path / "bad_rewards.py").write_text("def score(response):\n    return 1.0\n")
    with pytest.raises(ValueError):
        check_reward_function_contract("bad_rewards:score", str(tmp_path))


SCORES = torch.tensor([[0.1, 0.9, 0.4, 0.4], [2.0, 2.0, 2.0, 2.0]])  # [G, N]; the second group constant


@pytest.mark.parametrize("name", sorted(NORMALIZATIONS))
def test_registered_normalization_is_finite_and_keeps_the_shape(name):
    out = NORMALIZATIONS[name](SCORES)
    assert out.shape == SCORES.shape and out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize("name", sorted(COMBINES))
def test_registered_combine_is_finite_and_follows_the_model_score(name):
    verifiable = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
    out = COMBINES[name](verifiable, SCORES, 1.0, 0.5)
    moved = COMBINES[name](verifiable, SCORES + 1.0, 1.0, 0.5)
    assert out.shape == SCORES.shape and torch.isfinite(out).all()
    assert torch.all(moved > out), "a higher model score must raise the mixed reward (model weight 0.5)"
