"""``moerl.placement.Placement``: where each part of a run runs, decided once from the config; and nothing
else in moerl reads the fields it owns (``runtime.mode``, ``trainer.num_ranks``, ``rollout.kv_cache``,
``rollout.weight_dtype``) or tests a rollouts or trainer type outside its package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from moerl.config import load_config
from moerl.placement import IN_DRIVER, IN_PROCESS_TRANSPORT, LOCAL_PROCESSES, RAY_ACTORS, THREADS, Placement

ROOT = Path(__file__).resolve().parents[2] / "moerl"

# (overrides) -> (trainer ranks_run_on, rollout runs_on, driver: holds_policy, evaluates_start,
#                 evaluates_later, probes_precision; starts_rollouts_early, uses_ray, max_staleness)
CASES = [
    (["runtime.mode=sync"], (IN_DRIVER, IN_DRIVER, True, True, True, False, False, False, 0)),
    (["runtime.mode=async"], (IN_DRIVER, RAY_ACTORS, True, True, False, False, True, True, 2)),
    (
        ["runtime.mode=async", "trainer.num_ranks=2", "trainer.batch_groups=4"],
        (RAY_ACTORS, RAY_ACTORS, False, False, False, False, False, True, 2),
    ),
    (
        ["runtime.mode=sync", "trainer.num_ranks=2", "trainer.batch_groups=4"],
        (LOCAL_PROCESSES, IN_DRIVER, True, True, True, False, False, False, 0),
    ),
    (
        ["runtime.mode=async", "rollout.weight_dtype=fp8"],
        (IN_DRIVER, RAY_ACTORS, True, False, False, False, True, True, 2),
    ),
    (
        ["runtime.mode=sync", "rollout.weight_dtype=fp8"],
        (IN_DRIVER, IN_DRIVER, True, True, True, True, False, False, 0),
    ),
]


@pytest.mark.parametrize(("overrides", "expected"), CASES)
def test_each_mode_places_its_parts(overrides, expected):
    p = Placement.from_config(load_config(None, overrides))
    got = (
        p.trainer.ranks_run_on,
        p.rollout.runs_on,
        p.driver.holds_policy,
        p.driver.evaluates_start,
        p.driver.evaluates_later,
        p.driver.probes_precision,
        p.starts_rollouts_early,
        p.uses_ray,
        p.rollout.max_staleness,
    )
    assert got == expected


def test_sync_keeps_everything_in_the_driver_and_async_on_ray():
    sync = Placement.from_config(load_config(None, ["runtime.mode=sync", "rollout.num_workers=3"]))
    assert (sync.run_mode, sync.exchange_runs_on, sync.reward_runs_on, sync.env_runs_on) == (
        "sync",
        IN_DRIVER,
        IN_DRIVER,
        THREADS,
    )
    assert (sync.rollout.num_workers, sync.rollout.weight_transport, sync.ray_address) == (
        1,
        IN_PROCESS_TRANSPORT,
        None,
    )
    cfg = load_config(
        None, ["runtime.mode=async", "rollout.num_workers=3", "runtime.ray_address=10.0.0.1:6379"]
    )
    placed = Placement.from_config(cfg)
    assert (placed.exchange_runs_on, placed.reward_runs_on, placed.env_runs_on) == (RAY_ACTORS,) * 3
    assert (placed.rollout.num_workers, placed.rollout.weight_transport) == (3, "object_store")
    assert placed.ray_address == "10.0.0.1:6379" and not placed.starts_local_ray
    assert Placement.from_config(load_config(None, ["rollout.kv_cache=slots"])).rollout.cache_kind == "slots"


def test_single_process_ignores_the_run_layout():
    cfg = load_config(None, ["runtime.mode=async", "trainer.num_ranks=2", "trainer.batch_groups=4"])
    one = Placement.single_process(cfg)
    assert (one.run_mode, one.trainer.num_ranks, one.rollout.runs_on, one.uses_ray) == (
        "sync",
        1,
        IN_DRIVER,
        False,
    )


def test_the_placement_is_frozen():
    p = Placement.from_config(load_config(None, []))
    with pytest.raises(AttributeError):
        p.run_mode = "sync"  # type: ignore[misc]


# -- the placement owns these questions: nobody else reads the fields or tests the types -----------------

OWNED = {("runtime", "mode"), ("trainer", "num_ranks"), ("rollout", "kv_cache"), ("rollout", "weight_dtype")}
"""(config section, field) pairs only the placement and the config read."""
READERS = {"moerl/placement.py"}
TYPES = {"LocalRollouts": "moerl/runtime/", "RayRollouts": "moerl/runtime/", "LocalTrainer": "moerl/trainer/"}
TYPES |= {"TrainerGroup": "moerl/trainer/", "Trainer": "moerl/trainer/", "ShardedTrainer": "moerl/trainer/"}
"""Rollouts and trainer types -> the package whose own code may test them with ``isinstance``."""


def _section(node: ast.expr) -> str | None:
    """The config section ``node`` names: ``cfg.rollout`` / ``self.cfg.rollout`` -> ``rollout`` (not a
    placement's ``placement.rollout`` / ``Placement.from_config(cfg).rollout``); the local names ``r``,
    ``t``, ``rt``, ``rollout``, ``runtime`` of a section. A bare ``trainer`` is a Trainer, not a section."""
    if isinstance(node, ast.Attribute):
        base = node.value
        is_placement = isinstance(base, ast.Call) or "plac" in ast.unparse(base).lower()
        return None if is_placement else node.attr
    if isinstance(node, ast.Name):
        names = {"r": "rollout", "t": "trainer", "rt": "runtime", "rollout": "rollout", "runtime": "runtime"}
        return names.get(node.id)
    return None


def owned_reads(source: str) -> list[tuple[int, str]]:
    """``(line, "section.field")`` of every read of an ``OWNED`` config field in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if (_section(node.value), node.attr) in OWNED:
                out.append((node.lineno, f"{_section(node.value)}.{node.attr}"))
    return out


def type_tests(source: str) -> list[tuple[int, str]]:
    """``(line, type)`` of every ``isinstance(x, T)`` with ``T`` a rollouts or trainer type of ``TYPES``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            if len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                out += [(node.lineno, k.id) for k in kinds if isinstance(k, ast.Name) and k.id in TYPES]
    return out


def test_the_scans_find_reads_and_type_tests():
    src = (
        "cfg.runtime.mode\nr.kv_cache\nself.cfg.trainer.num_ranks\nx.mode\nisinstance(a, (LocalRollouts, int))\n"
        "placement.trainer.num_ranks\nPlacement.from_config(cfg).rollout.kv_cache\ntrainer.num_ranks\n"
    )
    assert owned_reads(src) == [(1, "runtime.mode"), (2, "rollout.kv_cache"), (3, "trainer.num_ranks")]
    assert type_tests(src) == [(5, "LocalRollouts")]


def test_only_the_placement_reads_where_parts_run():
    found = []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT.parent).as_posix()
        if rel in READERS or rel.startswith("moerl/config"):
            continue
        source = f.read_text()
        found += [f"{rel}:{line}: {what}" for line, what in owned_reads(source)]
        found += [
            f"{rel}:{line}: isinstance {t}" for line, t in type_tests(source) if not rel.startswith(TYPES[t])
        ]
    assert not found, "read the run's Placement instead:\n" + "\n".join(found)
