"""The learning series on ``/metrics`` beside the fleet series, and the refused-weights counter, scraped
while a short async run trains (1 Ray worker, ``object_store``) whose published version 2 was tampered
with: its first bucket leaves the trainer with an entry dropped and its checksum recomputed, so only the
parameter-set rule (``CheckedWeights``) can catch it.

- the endpoint serves the reward mean, held-out accuracy, policy loss, staleness... of the step it last
  recorded, equal to that step's ``metrics.jsonl`` record (sync runs write records and feed the endpoint
  through the same ``RunTelemetry.write_step``: ``tests/unit/test_prometheus.py`` covers the mapping);
- the worker never switches to version 2, ``weights/refused_total`` reaches >= 1 in ``metrics.jsonl`` and
  on ``/metrics`` (carried by the worker's liveness answers, collected while the trainer waits for
  batches: a few steps after the refusal), and the run completes with every task trained once (the
  worker switches at version 3).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import ray
from _runs import free_port
from conftest import short_config
from prometheus_client.parser import text_string_to_metric_families

from moerl.rundir.folder import RunDir, read_jsonl
from moerl.train import train
from moerl.weights import transports
from moerl.weights.buckets import bucket_digest


class Scraper:
    """Scrapes ``url`` every ``every_s`` on a thread, keeping every answer (parsed: name -> value of the
    unlabelled samples)."""

    def __init__(self, url: str, every_s: float = 0.05) -> None:
        self.url, self.every_s, self.scrapes = url, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=1) as r:
                    text = r.read().decode()
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(self.every_s)
                continue
            self.scrapes.append(
                {
                    s.name: s.value
                    for f in text_string_to_metric_families(text)
                    for s in f.samples
                    if not s.labels
                }
            )
            time.sleep(self.every_s)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.scrapes


def _run_scraped(tmp_path, init, *overrides):
    port = free_port()
    scraper = Scraper(f"http://127.0.0.1:{port}/metrics")
    try:
        summary = train(
            short_config(tmp_path, init, f"telemetry.metrics_port={port}", *overrides), live=False
        )
    finally:
        scrapes = scraper.stop()
    run = RunDir(next(Path(tmp_path).glob("run-*")))
    return summary, read_jsonl(run.metrics), scrapes


def _check_learning_series(scrapes: list[dict], records: list[dict]) -> None:
    """The newest scrape that carries the learning series equals the record of the step it names."""
    learned = [s for s in scrapes if "moerl_trainer_step" in s]
    assert learned, f"no scrape carried the learning series ({len(scrapes)} scrapes)"
    last = learned[-1]
    step = int(last["moerl_trainer_step"])
    record = records[step - 1]
    assert record["step"] == step
    for series, key in [
        ("moerl_reward_mean", "rollout/reward_mean"),
        ("moerl_policy_loss", "train/pg_loss"),
        ("moerl_entropy", "train/entropy"),
        ("moerl_staleness_mean", "buffer/staleness_mean"),
        ("moerl_staleness_max", "buffer/staleness_max"),
        ("moerl_train_tokens_per_second", "perf/train_tokens_per_s"),
    ]:
        assert last[series] == pytest.approx(record[key]), series
    evals = [r["eval/accuracy"] for r in records[:step] if r["eval/accuracy"] is not None]
    assert evals and last["moerl_eval_accuracy"] == pytest.approx(evals[-1])  # held between evals
    assert last["moerl_policy_version"] == record["policy_version"]  # the fleet series, beside


@pytest.fixture
def ray_session():
    yield
    ray.shutdown()


@pytest.mark.timeout(300)
def test_a_tampered_version_is_refused_counted_and_the_run_completes(
    tmp_path, tiny_init, ray_session, monkeypatch
):
    send = transports.ObjectStoreSink.send

    def tampering_send(self, bucket):
        if bucket.version == 2 and bucket.index == 0:  # an entry dropped, the checksum recomputed
            entries = bucket.entries[1:]
            bucket = dataclasses.replace(
                bucket, entries=entries, checksum=bucket_digest(entries, bucket.data)
            )
        return send(self, bucket)

    monkeypatch.setattr(transports.ObjectStoreSink, "send", tampering_send)
    summary, records, scrapes = _run_scraped(
        tmp_path,
        tiny_init,
        "runtime.mode=async",
        "runtime.weight_sync=object_store",
        "rollout.num_workers=1",
        "trainer.steps=6",
        "eval.every=2",
        "runtime.buffer_groups=4",
        "runtime.max_staleness=2",
        "fleet.check_every_s=0.2",  # liveness answers (which carry the count) often
    )
    assert (
        summary["status"] == "completed" and summary["tasks_lost"] == 0 and summary["tasks_duplicated"] == 0
    )
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4, 5, 6]
    _check_learning_series(scrapes, records)
    refused = [r["weights/refused_total"] for r in records]
    assert refused == sorted(refused) and refused[-1] >= 1, refused
    assert max(s.get("moerl_weights_refused_total", 0) for s in scrapes) >= 1
