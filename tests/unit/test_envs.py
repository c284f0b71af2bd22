import itertools

import pytest

from moerl.config import ConfigError, EnvConfig, TaskConfig, load_config
from moerl.envs import Environment, load_env_class
from moerl.envs.calculator import CalculatorEnv
from moerl.envs.guess import GuessEnv
from moerl.tasks import load_tokenizer, make_task


def _play(env_cls, cfg, prompt, actions):
    env = env_cls(cfg)
    env.reset(prompt)
    results = [env.step(a) for a in actions]
    return results


def test_calculator_tool_call_then_answer():
    cfg = EnvConfig()
    task = CalculatorEnv.make_task(cfg, num_eval=20, seed=0)
    p = task.eval_prompts()[0]
    expr = p.text.removesuffix("=?\n")
    obs, reward, done, info = _play(CalculatorEnv, cfg, p, [f"c {expr}"])[0]
    assert obs == f"={p.answer}\n" and reward == 0 and not done
    _, reward, done, info = _play(CalculatorEnv, cfg, p, [f"a {p.answer}"])[0]
    assert reward == 1.0 and done and info["correct"] == 1.0
    assert _play(CalculatorEnv, cfg, p, ["a 1"])[0].reward == 0.0
    assert _play(CalculatorEnv, cfg, p, ["c __import__('os')"])[0].observation == "=error\n"
    assert _play(CalculatorEnv, cfg, p, ["hello"])[0].info == {"correct": 0.0, "format": 0.0}


def test_guess_feedback_narrows_the_range_and_demonstration_wins():
    cfg = EnvConfig(name="guess")
    task = GuessEnv.make_task(cfg, num_eval=50, seed=0)
    for p in task.eval_prompts():
        actions = GuessEnv.demonstration(cfg, p)
        results = _play(GuessEnv, cfg, p, actions)
        assert results[-1].done and results[-1].reward == 1.0
        assert all(not r.done for r in results[:-1]) and len(actions) <= 5  # widths <= 31
    env = GuessEnv(cfg)
    env.reset(p := task.eval_prompts()[0])
    lo, hi = map(int, p.text.split()[1].split(".."))
    secret = int(p.answer)
    if secret > lo:
        assert env.step(f"g {lo}").observation == f">{lo + 1}..{hi}\n"


def test_held_out_split_is_disjoint_and_demos_reach_the_answer():
    tok = load_tokenizer(None)
    for name in ("calculator", "guess"):
        cfg = EnvConfig(name=name, max_turns=6, min_terms=2, max_terms=5, ops="+-")
        task = make_task(TaskConfig(name="env", num_eval=40), cfg)
        held = {p.id for p in task.eval_prompts()}
        train = {p.id for p in itertools.islice(task.train_prompts(0), 2000)}
        assert len(held) == 40 and not held & train
        for p in itertools.islice(task.train_prompts(1), 30):
            ex = task.sft_example(tok, p)
            assert len(ex.mask) == len(ex.ids) and sum(ex.mask[: ex.num_prompt]) == 0
            trained = tok.decode([t for t, m in zip(ex.ids, ex.mask, strict=True) if m])
            assert trained.rstrip("\n").split("\n")[-1].split()[-1] == p.answer


def test_long_tailed_terms():
    cfg = EnvConfig(ops="+-", min_terms=2, max_terms=8, terms_zipf=1.0)
    task = CalculatorEnv.make_task(cfg, num_eval=10, seed=0)
    terms = [p.text.count("+") + p.text.count("-") + 1 for p in itertools.islice(task.train_prompts(0), 3000)]
    counts = [terms.count(k) for k in range(2, 9)]
    assert counts[0] > counts[1] > counts[3] > counts[6] > 0


def test_registry_and_config_errors():
    assert load_env_class("moerl.envs.guess:GuessEnv") is GuessEnv
    assert issubclass(load_env_class("_envs:EchoEnv"), Environment)
    with pytest.raises(ValueError, match="not a subclass"):
        load_env_class("moerl.envs.calc:evaluate")
    with pytest.raises(ValueError, match="import path"):
        load_env_class("nocolon")
    with pytest.raises(ConfigError, match="env.name"):
        EnvConfig(name="chess")
    with pytest.raises(ConfigError, match="env.max_turns"):
        load_config(None, ["env.max_turns=0"])
    with pytest.raises(ValueError, match="needs the run's env section"):
        make_task(TaskConfig(name="env"))
    cfg = load_config(None, ["task.name=env", "env.name=guess", "env.num_workers=3"])
    assert cfg.env.num_workers == 3 and cfg.env.import_path == "moerl.envs.guess:GuessEnv"


@pytest.mark.parametrize("name", ["calculator", "guess"])
def test_shipped_env_configs_load_and_fit_the_model(name):
    from pathlib import Path

    cfg = load_config(Path(__file__).parents[2] / "configs" / f"env_{name}.yaml")
    assert cfg.task.name == "env" and cfg.env.name == name
    task = make_task(cfg.task, cfg.env)
    tok = load_tokenizer(None)
    slot = cfg.rollout.kv_token_budget // cfg.rollout.max_slots
    longest = max(len(task.sft_example(tok, p).ids) for p in itertools.islice(task.train_prompts(0), 300))
    assert longest <= min(slot, cfg.model.max_position_embeddings)
    assert cfg.env.max_tokens >= longest - min(len(tok.encode(p.text)) for p in task.eval_prompts())
