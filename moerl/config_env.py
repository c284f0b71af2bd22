"""Config of multi-turn environment episodes (``env:`` in a run config, used with ``task.name: env``);
re-exported by ``moerl.config``, which composes it into ``RunConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from moerl.configlib import ConfigError, check_range


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    """Environment workers and episode limits (``moerl.envs``).

    An episode is ``reset(task) -> observation``, then turns of ``step(action_text) -> observation,
    reward, done, info`` until ``done``, ``max_turns`` or ``max_tokens``. One policy turn is generated
    until a stop token (the tokenizer's eos or the environment's turn delimiter, a newline) or
    ``rollout.max_new_tokens``.
    """

    name: str = "calculator"
    """Built-in environment (``calculator``: arithmetic with a calculator tool; ``guess``: a
    higher/lower guessing game) or the import path ``package.module:Class`` of an
    ``moerl.envs.Environment`` subclass."""
    num_workers: int = 2
    """Environment workers per rollout worker: threads in sync mode, Ray actors (requesting the custom
    resource ``cpu`` when the cluster defines it) in async mode. Episodes are spread over them."""
    max_turns: int = 4
    """Most policy turns per episode; an episode that reaches it ends (finish reason ``length``)."""
    max_tokens: int = 96
    """Token budget of one episode's response: policy and observation tokens together (the prompt not
    counted). An episode that would exceed it ends (finish reason ``length``)."""
    step_timeout_s: float = 30.0
    """Seconds one environment call (reset or step) may take; past it the call counts as a timeout,
    the worker that hosts it is replaced and its episodes end as errors (their tasks are requeued)."""
    max_pending_per_worker: int = 4
    """Calls one environment worker serves at once (its threads); further calls wait on the rollout
    worker's side (backpressure: episodes stay parked, and no new task is leased while every slot holds
    an episode)."""
    num_cpus: float = 0.0
    """CPUs each environment actor requests from Ray (async mode); 0 lets them share the machine."""
    ops: str = "*"
    """calculator: operators of the problems, any of ``+-*``."""
    digits: int = 2
    """calculator: digits of each operand."""
    min_terms: int = 2
    """calculator: fewest operands of a problem."""
    max_terms: int = 2
    """calculator: most operands; with more than two the demonstrations call the tool once per
    operator, so the number of turns grows with the number of operands."""
    terms_zipf: float = 2.0
    """calculator: P(min_terms + j operands) is proportional to 1 / (j + 1) ** terms_zipf (a long tail
    of turns when max_terms > min_terms)."""
    demo_tool_frac: float = 0.5
    """calculator: share of warm-start demonstrations that call the tool (the others answer at once)."""
    step_latency_s: float = 0.0
    """calculator: seconds each tool call sleeps (a stand-in for a sandbox or a remote tool)."""
    min_width: int = 8
    """guess: fewest numbers in the secret's range."""
    max_width: int = 31
    """guess: most numbers in the secret's range."""
    max_value: int = 99
    """guess: largest number of any range."""
    demo_scan_frac: float = 0.0
    """guess: share of warm-start demonstrations that scan up from the low end (``lo``, ``lo + 1``, ...)
    instead of guessing midpoints; a scan rarely finds the secret within ``max_turns``."""

    def __post_init__(self) -> None:
        from moerl.envs.base import BUILTIN_ENVS  # here: moerl.envs loads torch, the config module must not

        if not self.name or (self.name not in BUILTIN_ENVS and ":" not in self.name):
            raise ConfigError(
                f"env.name={self.name!r}: choose {', '.join(BUILTIN_ENVS)} or an import path 'package.module:Class'"
            )
        check_range("env.num_workers", self.num_workers, 1)
        check_range("env.max_turns", self.max_turns, 1)
        check_range("env.max_tokens", self.max_tokens, 2)
        check_range("env.step_timeout_s", self.step_timeout_s, 0.001)
        check_range("env.max_pending_per_worker", self.max_pending_per_worker, 1)
        check_range("env.num_cpus", self.num_cpus, 0.0)
        if not self.ops or any(op not in "+-*" for op in self.ops):
            raise ConfigError(f"env.ops={self.ops!r}: use one or more of '+', '-', '*'")
        check_range("env.digits", self.digits, 1, 6)
        check_range("env.min_terms", self.min_terms, 2)
        check_range("env.max_terms", self.max_terms, self.min_terms)
        check_range("env.terms_zipf", self.terms_zipf, 0.0)
        check_range("env.demo_tool_frac", self.demo_tool_frac, 0.0, 1.0)
        check_range("env.step_latency_s", self.step_latency_s, 0.0)
        check_range("env.min_width", self.min_width, 2)
        check_range("env.max_width", self.max_width, self.min_width)
        check_range("env.max_value", self.max_value, self.max_width)
        check_range("env.demo_scan_frac", self.demo_scan_frac, 0.0, 1.0)

    @property
    def import_path(self) -> str:
        """``package.module:Class`` of the environment (built-in names resolved)."""
        from moerl.envs.base import BUILTIN_ENVS

        return BUILTIN_ENVS.get(self.name, self.name)


def check_episode_run(task_name: str, return_routed_experts: bool) -> None:
    """Raise ``ConfigError`` for run settings episodes do not support (``RunConfig`` calls it)."""
    if task_name == "env" and return_routed_experts:
        raise ConfigError("rollout.return_routed_experts is not supported with task.name=env (episodes)")


__all__ = ["ConfigError", "EnvConfig", "check_episode_run"]
