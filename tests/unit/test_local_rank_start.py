"""How sync mode starts its local trainer ranks (``moerl.trainer.distributed.group.LocalRanks``): forked
from a fork server that has imported the rank's code once, each under the driver's environment of the
moment (``serve_in_env``), as a ``spawn``ed rank would have it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import moerl.trainer.distributed.rank as rank_module

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


_DRIVER = f"""
import os, sys
sys.path.insert(0, {str(HERE)!r})
from moerl.trainer.distributed.group import _rank_context
from _rank_probe import probe
ctx = _rank_context()
for value in ("first", "second"):  # the second rank forks from the server the first one started
    os.environ["MOERL_PROBE"] = value
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=probe, args=(child,), daemon=True)
    proc.start()
    print(*parent.recv(), os.getpid())
    proc.join(30)
"""


def test_ranks_fork_from_a_server_that_imported_the_rank_code_once():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    out = subprocess.run(
        [sys.executable, "-c", _DRIVER], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for line in out.stdout.splitlines():
        preloaded, parent, _, driver = line.split()
        assert preloaded == "True", line  # imported before the rank ran a line: the fork server's import
        assert int(parent) != int(driver), line  # a child of the fork server, not of the driver
    # the environment the server started with is not the rank's: each rank sees the driver's own
    # (serve_in_env does that for real ranks; this probe reads the fork server's, so it shows the need)
    assert [line.split()[2] for line in out.stdout.splitlines()] == ["first", "first"]


def test_serve_in_env_runs_the_rank_under_the_drivers_environment(monkeypatch):
    seen = {}
    monkeypatch.setattr(
        rank_module, "serve", lambda spec, conn: seen.update(os.environ, spec=spec, conn=conn)
    )
    saved = dict(os.environ)
    try:
        os.environ["MOERL_STALE"] = "from the fork server"
        rank_module.serve_in_env({"MOERL_RANK_THREADS": "3"}, "spec", "conn")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert seen == {"MOERL_RANK_THREADS": "3", "spec": "spec", "conn": "conn"}  # nothing of the server's
