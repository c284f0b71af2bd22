"""Communication errors are counted where they are caught and reach moerl_comm_errors_total."""

from __future__ import annotations

import socket

from moerl.runtime.counters import comm_error_counts
from moerl.runtime.notice import HttpNotice
from moerl.telemetry.prometheus import MetricsExporter


def test_an_unreachable_notice_endpoint_counts_as_a_provider_error():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exporter = MetricsExporter()
    before = comm_error_counts()["provider"]
    notice = HttpNotice(f"http://127.0.0.1:{port}/latest/meta-data/spot/instance-action", timeout_s=0.5)
    assert notice.check() is None and notice.check() is None
    assert comm_error_counts()["provider"] == before + 2
    assert 'moerl_comm_errors_total{kind="provider"} 2.0' in exporter.render().decode()
