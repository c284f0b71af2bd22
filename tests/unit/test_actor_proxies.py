"""The Ray proxies a worker talks to accept exactly the arguments of the local classes they stand for."""

import inspect

from moerl.runtime.actors import _QueueProxy
from moerl.runtime.queue import TaskQueue


def test_queue_proxy_methods_take_the_queue_methods_arguments():
    for name in ("lease", "heartbeat", "release", "settle"):
        local = list(inspect.signature(getattr(TaskQueue, name)).parameters)[1:]
        proxy = list(inspect.signature(getattr(_QueueProxy, name)).parameters)[1:]
        assert proxy == local, f"_QueueProxy.{name}{proxy} != TaskQueue.{name}{local}"


def test_queue_proxy_release_forwards_partial(monkeypatch):
    calls = []
    monkeypatch.setattr("moerl.runtime.actors._remote_call", lambda *a, **k: calls.append((a, k)))
    _QueueProxy("handle").release("lease", partial=("p",))
    assert calls == [(("handle", "call", "release", "lease"), {"partial": ("p",)})]
