"""Actors that never run a model start without torch (issue 52: an async run's start-up).

The exchange actor (queue + buffer) and the environment worker actors import only the module their class
lives in; each is checked in a fresh interpreter, as a Ray worker process would load it.
"""

import pickle
import subprocess
import sys

from moerl.config import load_config
from moerl.runtime.buffer import has_reward_variance
from moerl.runtime.data_plane import is_dynamic_sampling, make_buffer, make_queue
from moerl.tasks import load_tokenizer, make_task

CHILD = """
import pickle, sys
from moerl.runtime.ray.exchange import ExchangeActor
import moerl.envs.calculator, moerl.envs.guess, moerl.envs.pool_ray
cfg = pickle.loads(bytes.fromhex(sys.argv[1]))
ex = ExchangeActor(cfg, None, 0, dynamic_sampling=False)
assert len(ex.lease("w", 60.0, 2)) == 2
print(sorted(m for m in ("torch", "numpy", "moerl.rl", "moerl.rollout", "moerl.models") if m in sys.modules))
"""


def test_exchange_and_env_actor_modules_load_no_torch():
    cfg = load_config(None, ["trainer.batch_groups=2", "rollout.group_size=2", "task.num_eval=4"])
    out = subprocess.run(
        [sys.executable, "-c", CHILD, pickle.dumps(cfg).hex()], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_dynamic_sampling_answer_sets_the_buffer_filter():
    for preset, expected in (("grpo", False), ("dapo", True)):
        cfg = load_config(None, [f"algorithm.preset={preset}", "task.num_eval=4"])
        assert is_dynamic_sampling(cfg) is expected
        tok = load_tokenizer(None)
        queue = make_queue(cfg, make_task(cfg.task, cfg.env, tok), tok)
        assert make_buffer(cfg, queue)._filters == ((has_reward_variance,) if expected else ())
        assert make_buffer(cfg, queue, dynamic_sampling=not expected)._filters == (
            () if expected else (has_reward_variance,)
        )
