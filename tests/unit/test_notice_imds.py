"""Spot notices on EC2 and EKS: IMDSv2 against a local metadata server, SIGTERM as pod termination.

The server behaves like the EC2 instance metadata service with IMDSv2 required: ``PUT
/latest/api/token`` with a TTL header gives a token; a GET without a valid token is 401; the spot
``instance-action`` and the rebalance recommendation are 404 until the test sets them. Both notice
paths drain a real rollout worker with nothing lost: every leased task is delivered or back in the queue.
"""

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _drain_rig import MAX_NEW, new_worker, rig, run_until_notice

from moerl.config import FleetConfig
from moerl.runtime.drain import Drainer
from moerl.runtime.notice import (
    HttpNotice,
    ImdsNotice,
    NoticeWatcher,
    instance_action_document,
    watcher_from_config,
)


class _Imds(http.server.BaseHTTPRequestHandler):
    tokens: set
    log: list
    action: str | None = None
    rebalance: str | None = None

    def do_PUT(self):  # noqa: N802 - http.server's naming
        cls = type(self)
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        if self.path != "/latest/api/token" or ttl is None or not 1 <= int(ttl) <= 21600:
            cls.log.append(("PUT", self.path, 400))
            return self.send_error(400)
        token = f"token-{len(cls.tokens)}"
        cls.tokens.add(token)
        cls.log.append(("PUT", self.path, 200))
        self._reply(token)

    def do_GET(self):  # noqa: N802
        cls = type(self)
        if self.headers.get("X-aws-ec2-metadata-token") not in cls.tokens:
            cls.log.append(("GET", self.path, 401))
            return self.send_error(401)
        body = {
            "/latest/meta-data/spot/instance-action": cls.action,
            "/latest/meta-data/events/recommendations/rebalance": cls.rebalance,
        }.get(self.path)
        cls.log.append(("GET", self.path, 404 if body is None else 200))
        if body is None:
            return self.send_error(404)
        self._reply(body)

    def _reply(self, text):
        data = text.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def imds():
    handler = type("Imds", (_Imds,), {"tokens": set(), "log": [], "action": None, "rebalance": None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_server_requires_a_token_like_imdsv2(imds, caplog):
    handler, url = imds
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url + "/latest/meta-data/spot/instance-action", timeout=2)
    assert e.value.code == 401
    # the plain-GET poller gets 401 on an IMDSv2-only instance: an error, never a notice
    plain = HttpNotice(url + "/latest/meta-data/spot/instance-action")
    handler.action = instance_action_document("terminate", 120.0)
    with caplog.at_level("WARNING", logger="moerl.runtime.notice"):
        assert plain.check() is None and plain.num_errors == 1
    assert "set fleet.imds_url" in caplog.text


def test_imds_notice_404_then_instance_action(imds):
    handler, url = imds
    src = ImdsNotice(url, token_ttl_s=60)
    assert src.check() is None and src.check() is None and src.num_errors == 0
    assert handler.log == [
        ("PUT", "/latest/api/token", 200),
        ("GET", "/latest/meta-data/spot/instance-action", 404),
        ("GET", "/latest/meta-data/events/recommendations/rebalance", 404),
        ("GET", "/latest/meta-data/spot/instance-action", 404),  # the token is reused
        ("GET", "/latest/meta-data/events/recommendations/rebalance", 404),
    ]
    handler.action = json.dumps({"action": "stop", "time": "2026-11-29T12:00:00Z"})
    notice = src.check()
    assert (notice.source, notice.action) == ("imds", "stop")
    assert notice.deadline_epoch_s == 20786 * 86400 + 12 * 3600


def test_expired_token_is_renewed_after_a_401(imds):
    handler, url = imds
    src = ImdsNotice(url)
    assert src.check() is None
    handler.tokens.clear()  # the service forgot every token (expired, or a restarted instance)
    handler.action = instance_action_document("terminate", 60.0)
    assert src.check().action == "terminate" and src.num_errors == 0
    assert [e for e in handler.log if e[0] == "PUT"] == [("PUT", "/latest/api/token", 200)] * 2
    assert ("GET", "/latest/meta-data/spot/instance-action", 401) in handler.log


def test_rebalance_recommendation_is_a_notice_unless_disabled(imds):
    handler, url = imds
    handler.rebalance = json.dumps({"noticeTime": "2026-11-29T11:58:00Z"})
    assert ImdsNotice(url, rebalance=False).check() is None
    notice = ImdsNotice(url).check()
    assert (notice.source, notice.action, notice.deadline_epoch_s) == ("imds", "rebalance", None)


def test_unreachable_or_broken_service_is_counted_not_a_notice(imds):
    handler, url = imds
    handler.action = "not json"
    src = ImdsNotice(url)
    assert src.check() is None and src.num_errors == 1
    dead = ImdsNotice("http://127.0.0.1:9", timeout_s=0.5)
    assert dead.check() is None and dead.num_errors == 1
    with pytest.raises(ValueError, match="token_ttl_s"):
        ImdsNotice(url, token_ttl_s=0)
    cfg = FleetConfig(imds_url=url, handle_sigterm=False)
    assert [s.name for s in watcher_from_config(cfg, "w0").sources] == ["imds"]


def test_imds_notice_drains_the_worker_with_nothing_lost(imds):
    handler, url = imds
    worker, queue, buffer = rig()

    def mark_after_a_few_steps(step):
        if step == 3:  # two groups are in flight, 4 tokens each
            handler.action = instance_action_document("terminate", 120.0)
            # the loop goes on only once the poller has seen it, as a worker would between two steps of
            # a real engine; without the wait, a stalled poller on a loaded machine saw it only after the
            # groups had finished (nothing left to drain)
            assert watcher.event.wait(10.0), "the IMDS notice was not seen within 10 s"

    with NoticeWatcher([ImdsNotice(url)], poll_s=0.02) as watcher:
        run_until_notice(worker, watcher, on_step=mark_after_a_few_steps)
    assert watcher.notice.source == "imds"
    in_flight = worker.num_in_flight
    assert in_flight == 2
    report = Drainer(600.0).drain(worker, watcher.notice)
    worker.release_all()
    assert (report.groups_delivered, report.groups_released, report.tokens_discarded) == (in_flight, 0, 0)
    stats = queue.stats()
    assert stats.outstanding == 0 and stats.acked == buffer.metrics().depth == worker.stats.groups_put
    assert all(len(s.response_ids) == MAX_NEW for g in buffer.get(stats.acked, timeout=0) for s in g.samples)


CHILD = """
import json, sys
sys.path.insert(0, {unit!r})
from _drain_rig import rig, run_until_notice
from moerl.config import FleetConfig
from moerl.runtime.drain import Drainer
from moerl.runtime.notice import watcher_from_config

cfg = FleetConfig(handle_sigterm=True, drain_grace_s=60.0)
worker, queue, buffer = rig()
watcher = watcher_from_config(cfg, "w0").start()
run_until_notice(worker, watcher, on_step=lambda s: s == 3 and print("ready", flush=True))
in_flight = worker.num_in_flight
report = Drainer(cfg.drain_grace_s).drain(worker, watcher.notice)
worker.release_all()
stats = queue.stats()
print(json.dumps(dict(source=watcher.notice.source, in_flight=in_flight, delivered=report.groups_delivered,
    released=report.groups_released, discarded=report.tokens_discarded, outstanding=stats.outstanding,
    acked=stats.acked, depth=buffer.metrics().depth)), flush=True)
watcher.stop(resend_sigterm_after_s=0.1)  # then exit on SIGTERM, as the pod's process does
import time; time.sleep(30)
"""


def test_sigterm_as_pod_termination_drains_with_nothing_lost():
    """Kubernetes terminates a pod with SIGTERM (SIGKILL after the grace period): the worker drains,
    delivers its in-flight groups, and then exits on the re-sent SIGTERM well within the grace."""
    unit = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), unit])}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(unit=unit)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGTERM)
        result = json.loads(child.stdout.readline())
        assert child.wait(timeout=30) == -signal.SIGTERM
    finally:
        child.kill()
    assert result["source"] == "sigterm" and result["in_flight"] == 2
    assert (result["delivered"], result["released"], result["discarded"]) == (2, 0, 0)
    assert result["outstanding"] == 0 and result["acked"] == result["depth"] >= 2


def test_released_groups_are_finished_by_the_next_worker(imds):
    """A notice with no time to finish (deadline now): groups go back to the queue, none is lost."""
    handler, url = imds
    worker, queue, buffer = rig()
    handler.action = instance_action_document("terminate", 0.0)
    with NoticeWatcher([ImdsNotice(url)], poll_s=0.02) as watcher:
        watcher.event.wait(5.0)
        worker.step()
    report = Drainer(600.0, margin_s=0.0).drain(worker, watcher.notice)
    worker.release_all()
    assert report.groups_released == 2 and queue.stats().outstanding == 0
    after = new_worker("w1", queue, buffer)
    after.run(num_groups=2)
    assert queue.stats().acked == 2 and {g.worker_id for g in buffer.get(2, timeout=0)} == {"w1"}
