"""``moerl train --ray-address`` started inside a node of a namespaced cluster, and its progress."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from _runs import DEFAULT_CONFIG
from raynodes import RayNodes

from moerl.rundir.folder import read_jsonl

# ``moerl train`` without its report figures (``moerl.train.plot_report``), as in-process test runs skip them
# (``_runs.report_figures_skipped``): no test here reads ``report.png``, and drawing the two figures is 4-7
# CPU-s of a run on the loaded cores
TRAIN_WITHOUT_FIGURES = (
    "import sys, moerl.train; moerl.train.plot_report = lambda path: None; "
    "from moerl.cli import main; sys.exit(main(sys.argv[1:]))"
)


class Driver:
    """``moerl train`` (the driver: the trainer, the weight store's writer) inside node ``node`` of
    ``ray``'s cluster with ``overrides`` (``--set``), its output in ``log``; runs land in ``out``. It draws
    no report figures (``TRAIN_WITHOUT_FIGURES``)."""

    def __init__(self, ray: RayNodes, node: int, out: Path, log: Path, overrides: list[str]):
        self.out, self.log = out, log
        argv = [*ray.python, "-c", TRAIN_WITHOUT_FIGURES, "train", "--config", str(DEFAULT_CONFIG)]
        argv += ["--ray-address", ray.address]
        for o in [*overrides, f"output_dir={out}"]:
            argv += ["--set", o]
        self.proc = ray.c.popen(node, argv, env=ray.env, stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def tail(self, n: int = 3000) -> str:
        """The last ``n`` characters of its output."""
        return self.log.read_text(errors="replace")[-n:]

    def steps_done(self) -> int:
        """Records in the run's ``metrics.jsonl`` so far (0 before the run folder exists)."""
        runs = list(self.out.glob("*/metrics.jsonl"))
        return len(read_jsonl(runs[0])) if runs else 0

    def wait_steps(self, n: int, timeout_s: float) -> None:
        """Wait until ``n`` steps are done; AssertionError (with its output) if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while self.steps_done() < n:
            assert self.proc.poll() is None, self.tail()
            assert time.monotonic() < deadline, f"not {n} steps after {timeout_s:.0f} s: {self.tail()}"
            time.sleep(0.5)

    def finish(self, timeout_s: float) -> int:
        """Its exit status; AssertionError (with its output) if it runs past ``timeout_s``."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"run did not finish in {timeout_s:.0f} s: {self.tail()}") from None

    def run_folder(self) -> Path:
        """The run's folder (``out/<name>-<time>``)."""
        return next(p.parent for p in self.out.glob("*/config.yaml"))


def actor_nodes(ray: RayNodes, class_name: str) -> list[int]:
    """Indices of the cluster's namespaced nodes that run a Ray actor of ``class_name``, one entry per
    actor process (Ray titles an actor's process ``ray::<class name>``), read from ``/proc``."""
    found = []
    for node in ray.c.nodes:
        for pid in ray.c.node_pids(node.index):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    title = f.read().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if title.startswith(f"ray::{class_name}"):
                found.append(node.index)
    return found
