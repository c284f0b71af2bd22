"""The distributed tests' fork server (``dist_harness.start_fork_server``): a world's ranks, and the local
trainer ranks of a sync run, start with every case module and the rank code already imported."""

from __future__ import annotations

import multiprocessing as mp
import sys

from dist_harness import _PRELOAD, start_fork_server


def imported_at_entry(conn) -> None:
    """Send the ``_PRELOAD`` modules this process finds imported before it imports anything itself."""
    conn.send([m for m in _PRELOAD if m in sys.modules])


def test_every_case_module_is_imported_before_a_rank_starts():
    assert {"trainer_cases", "ep_engine_cases", "moerl.trainer.distributed.rank"} <= set(_PRELOAD)
    start_fork_server()  # as tests/distributed/conftest.py does (no-op once running), then fork as run_world does
    ctx = mp.get_context("forkserver")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=imported_at_entry, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(60), "the forked process did not answer"
    assert parent.recv() == _PRELOAD
    proc.join(10)
