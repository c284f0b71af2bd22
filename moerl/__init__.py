"""moerl: reinforcement-learning post-training (GRPO, PPO and variants) of Mixture-of-Experts LMs.

Packages, in the direction data flows: ``tasks`` -> ``rollout`` -> ``runtime`` (queue, buffer,
trainer, weight store) -> back to ``rollout``; ``models`` is single-device model code, ``ep`` shards
its experts, ``rl`` holds the pure loss and advantage functions, ``telemetry`` writes metrics and plots.
See docs/architecture.md.
"""

__version__ = "0.1.0"
