"""The distributed tests' fork server (``dist_harness.start_fork_server``): a world's ranks, and the local
trainer ranks of a sync run, start with every case module and the rank code already imported."""

from __future__ import annotations

import sys

from dist_harness import PRELOAD, run_world


def imported_at_entry(rank: int, world_size: int) -> list[str]:
    """The ``PRELOAD`` modules this rank finds imported before it imports anything itself."""
    return [m for m in PRELOAD if m in sys.modules]


def test_every_case_module_is_imported_before_a_rank_starts():
    assert {"trainer_cases", "ep_engine_cases", "moerl.trainer.distributed.rank"} <= set(PRELOAD)
    for found in run_world(imported_at_entry, 2):
        assert found == PRELOAD
