"""Options of ``moerl plan`` and its presets: light (argparse only), so that building the ``moerl`` parser
imports neither torch nor rich. The work happens in ``moerl.plan.cli``."""

from __future__ import annotations

import argparse
from pathlib import Path

CALIBRATION = Path(__file__).with_name("calibration.json")
"""The fitted constants shipped with moerl (``python -m moerl.plan.calibrate`` rewrites it)."""
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
"""``bench/results`` of the repository this moerl is imported from (absent in an installed wheel): the
default of ``--results`` for ``moerl plan --validate`` and ``python -m moerl.plan.calibrate``."""

COLUMNS = 100
"""Width of ``moerl plan``'s output (tables and lines wrap within it)."""
WIDE_COLUMNS = 200
"""Width with ``--wide``."""

PRESETS: dict[str, dict] = {
    # The mission: 48 p5en (16 training, 32 rollout), a GLM-5-744B-A40B-like super-sparse MoE (top-8 of 256),
    # EP over 2 nodes per rollout replica, group-limited routing assumed as DeepSeek-V3's (4 of 8 groups).
    "mission": {},
    "mission-spot": {"spot_rollout": True},
    # moerl's reference bench model on one p5en node (EP inside the node: no inter-node traffic).
    "bench-reference": {"model": "reference", "total_nodes": 2, "train_nodes": 1, "rollout_ep_nodes": 1,
                        "prompts_per_step": 32, "group_size": 8, "prompt_len": 128, "response_len": 128},
    "qwen3-235b": {"model": "qwen3-235b-a22b", "router_groups": 1, "topk_groups": 1},
    "deepseek-v3": {"model": "deepseek-v3"},
    # configs/cluster_mission.yaml's scenario: DeepSeek-V3, 16 training nodes (EP 64 = 8 nodes), 32 rollout
    # workers of one node each (EP 8) with FP8 weights, 256 sequences per rollout GPU, 256 prompts x 16
    # samples per step, 512 + 3584 tokens, Spot rollout nodes (what differs: docs/cluster.md, "Run on a cluster").
    "mission-recipe": {"model": "deepseek-v3", "total_nodes": 48, "train_nodes": 16, "train_ep_nodes": 8,
                       "rollout_ep_nodes": 1, "rollout_rows_per_gpu": 256, "weight_bytes": 1.0,
                       "prompts_per_step": 256, "group_size": 16, "prompt_len": 512, "response_len": 3584,
                       "max_staleness": 1, "checkpoint_every": 50, "spot_rollout": True},
}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's options (``moerl/cli.py`` calls this)."""
    base = p.add_mutually_exclusive_group()  # a plan file starts from the mission preset, as its docs say
    base.add_argument("--preset", default=None, help=f"one of {', '.join(PRESETS)} (default: mission)")
    base.add_argument(
        "--file", default=None, help="YAML plan: a mapping of plan parameters over the mission preset's"
    )
    base.add_argument(
        "--config",
        default=None,
        metavar="RUN.yaml",
        help="a run config: its model section, cluster node groups, layout and batch as the plan "
        "(moerl.cluster.plan_inputs), over the mission preset's other parameters",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PARAM=VALUE",
        help="repeatable: a plan parameter (moerl.plan.predict.Plan). Defaults that defer: top_k=0 the model's "
        "own (at most its experts), train_share=0 off (train_nodes as given; else in (0, 1)), "
        "price_on_demand=0 the catalog's (else > 0 $/node-hour), interruptions_per_hour<0 the catalog's; "
        "each numeric parameter has a valid range (moerl.plan.inputs.Plan), a value outside it is an error",
    )
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="PARAM=V1,V2,...",
        help="repeatable, one per parameter: grid of all combinations",
    )
    p.add_argument("--json", default=None, help="write all points to this JSON file")
    p.add_argument("--csv", default=None, help="write all points to this CSV file")
    p.add_argument(
        "--plot", default=None, help="PNG: rollout tok/s and $/1000 episodes against the first sweep"
    )
    p.add_argument("--calibration", default=str(CALIBRATION))
    p.add_argument(
        "--validate",
        action="store_true",
        help="compare with bench/results and exit (alone: with --calibration, --results)",
    )
    p.add_argument(
        "--results", default=None, help=f"bench results folder read by --validate (default: {RESULTS})"
    )
    p.add_argument(
        "--sensitivity", action="store_true", help="one-at-a-time sensitivity of the hier/flat ratio"
    )
    p.add_argument(
        "--assumptions",
        action="store_true",
        help="after the answer, list every input of the prediction with its source (~80 lines)",
    )
    p.add_argument(
        "--published",
        action="store_true",
        help="predict the published figures of NeMo-RL and verl runs (moerl.plan.published) and exit "
        "(alone: with --calibration, --json)",
    )
    p.add_argument(
        "--schedules",
        action="store_true",
        help="the hier/flat ratio of useful episodes/s and $ per 1000 useful episodes under every schedule and "
        "weight transport, and the ratio's sensitivity to each calibrated value (moerl.plan.matrix)",
    )
    p.add_argument(
        "--wide",
        action="store_true",
        help=f"every column (EP ms/step, inter-node MB/layer), up to {WIDE_COLUMNS} columns wide; "
        f"default: {COLUMNS} columns",
    )
