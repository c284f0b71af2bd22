"""Termination notices: instance-action parsing, file / HTTP / SIGTERM sources, the watcher."""

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from moerl.config import FleetConfig
from moerl.runtime.notice import (
    FileNotice,
    HttpNotice,
    NoticeWatcher,
    SigtermNotice,
    TerminationNotice,
    instance_action_document,
    notice_file_for,
    parse_instance_action,
    watcher_from_config,
)


def test_parse_instance_action_reads_action_and_deadline():
    n = parse_instance_action(
        '{"action": "stop", "time": "2026-11-29T12:00:30Z"}', source="http", received_at=5.0
    )
    assert (n.source, n.action, n.received_at) == ("http", "stop", 5.0)
    # 2026-11-29T12:00:30Z as a Unix time: days from 1970-01-01 to 2026-11-29 = 20786
    assert n.deadline_epoch_s == 20786 * 86400 + 12 * 3600 + 30
    assert n.seconds_left(now_epoch_s=n.deadline_epoch_s - 42.0) == 42.0


def test_parse_instance_action_empty_is_terminate_without_deadline():
    n = parse_instance_action("", source="file", received_at=0.0)
    assert n.action == "terminate" and n.deadline_epoch_s is None and n.seconds_left() is None


@pytest.mark.parametrize(
    "text, match",
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"action": "explode"}', "unknown action"),
        ('{"time": "tomorrow"}', "not ISO 8601"),
    ],
)
def test_parse_instance_action_rejects_bad_documents(text, match):
    with pytest.raises(ValueError, match=match):
        parse_instance_action(text, source="http", received_at=0.0)


def test_instance_action_document_round_trips():
    n = parse_instance_action(instance_action_document("terminate", 60.0), source="file", received_at=0.0)
    assert n.action == "terminate"
    assert 58.0 <= n.seconds_left() <= 61.0  # the document has whole seconds


def test_file_notice_appears_and_tolerates_garbage(tmp_path):
    src = FileNotice(tmp_path / "w0.json")
    assert src.check() is None
    (tmp_path / "w0.json").write_text("not json")
    n = src.check()
    assert n is not None and n.source == "file" and n.action == "terminate"
    (tmp_path / "w0.json").write_text('{"action": "hibernate"}')
    assert src.check().action == "hibernate"


class _SpotEndpoint(http.server.BaseHTTPRequestHandler):
    """404 until ``document`` is set, then 200 with it (like the EC2 metadata endpoint)."""

    document: str | None = None
    status: int = 0

    def do_GET(self):  # noqa: N802 - http.server's naming
        cls = type(self)
        if cls.status:
            self.send_error(cls.status)
        elif cls.document is None:
            self.send_error(404)
        else:
            body = cls.document.encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def spot_endpoint():
    handler = type("Handler", (_SpotEndpoint,), {"document": None, "status": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}/latest/meta-data/spot/instance-action"
    server.shutdown()
    server.server_close()


def test_http_notice_404_then_document(spot_endpoint):
    handler, url = spot_endpoint
    src = HttpNotice(url, timeout_s=2.0)
    assert src.check() is None and src.num_errors == 0  # 404: no notice, not an error
    handler.document = json.dumps({"action": "terminate", "time": "2026-11-29T12:00:00Z"})
    n = src.check()
    assert n is not None and n.source == "http" and n.action == "terminate"
    assert n.deadline_epoch_s == 20786 * 86400 + 12 * 3600


def test_http_notice_errors_are_counted_not_notices(spot_endpoint):
    handler, url = spot_endpoint
    handler.status = 500
    src = HttpNotice(url, timeout_s=2.0)
    assert src.check() is None and src.num_errors == 1
    handler.status, handler.document = 0, "garbage"
    assert src.check() is None and src.num_errors == 2
    dead = HttpNotice("http://127.0.0.1:9/", timeout_s=0.5)  # discard port: connection refused
    assert dead.check() is None and dead.num_errors == 1
    with pytest.raises(ValueError, match="must start with http"):
        HttpNotice("ftp://x")


def test_watcher_polls_http_endpoint_and_sets_event(spot_endpoint):
    handler, url = spot_endpoint
    seen = []
    with NoticeWatcher([HttpNotice(url)], poll_s=0.05, on_notice=seen.append) as watcher:
        time.sleep(0.15)
        assert not watcher.is_set()
        handler.document = instance_action_document("terminate", 90.0)
        assert watcher.event.wait(5.0)
    assert watcher.notice.source == "http" and seen == [watcher.notice]


def test_watcher_keeps_first_notice_and_manual_notify(tmp_path):
    watcher = NoticeWatcher([FileNotice(tmp_path / "n")], poll_s=1.0)
    assert watcher.poll_once() is None
    watcher.notify()
    first = watcher.notice
    assert watcher.is_set() and first.source == "manual"
    (tmp_path / "n").write_text("")
    assert watcher.poll_once() is first
    watcher.notify(TerminationNotice("file", "stop", 0.0))
    assert watcher.notice is first
    with pytest.raises(ValueError, match="poll_s"):
        NoticeWatcher([], poll_s=0)


def test_sigterm_sets_event_and_restores_handler():
    before = signal.getsignal(signal.SIGTERM)
    watcher = NoticeWatcher([SigtermNotice()], poll_s=1.0).start()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert watcher.event.wait(5.0)
        assert watcher.notice.source == "sigterm"
    finally:
        watcher.stop()
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigterm_off_main_thread_is_not_installed():
    result = []
    t = threading.Thread(target=lambda: result.append(SigtermNotice().install()))
    t.start()
    t.join()
    assert result == [False]


def test_watcher_from_config_builds_sources(tmp_path):
    cfg = FleetConfig(
        notice_file=str(tmp_path / "{worker_id}.notice"),
        notice_url="http://127.0.0.1:9/x",
        handle_sigterm=False,
        notice_poll_s=0.5,
    )
    watcher = watcher_from_config(cfg, "rollout-3")
    assert [s.name for s in watcher.sources] == ["file", "http"] and watcher.poll_s == 0.5
    assert watcher.sources[0].path == tmp_path / "rollout-3.notice"
    assert notice_file_for(FleetConfig(), "w", tmp_path) == tmp_path / "w.json"
    assert notice_file_for(FleetConfig(), "w", None) is None
    assert [s.name for s in watcher_from_config(FleetConfig(), "w").sources] == ["sigterm"]


def test_sigterm_is_resent_to_the_restored_handler_after_the_drain():
    """A child process drains on SIGTERM, then stop() hands SIGTERM on to the default handler: it exits."""
    script = (
        "import os, signal, sys, time\n"
        "from moerl.runtime.notice import NoticeWatcher, SigtermNotice\n"
        "w = NoticeWatcher([SigtermNotice()], poll_s=1.0).start()\n"
        "print('ready', flush=True)\n"
        "assert w.event.wait(20)\n"
        "print('draining', flush=True)\n"
        "w.stop(resend_sigterm_after_s=0.1)\n"
        "time.sleep(20)\n"
        "print('not terminated', flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    child.send_signal(signal.SIGTERM)
    assert child.stdout.readline() == "draining\n"
    assert child.wait(timeout=30) == -signal.SIGTERM
    assert child.stdout.read() == ""
