"""``moerl.runtime.ray.local`` without starting Ray: which processes count as Ray's, the process tree, bad
arguments, and the run's ``init_ray`` starting Ray again after Ray's startup timeout (real Ray processes:
tests/distributed/test_ray_local_start.py)."""

import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from moerl import processes
from moerl.config import load_config
from moerl.runtime.ray import local

RAY_DIR = "/venv/lib/python3.11/site-packages/ray"
TIMEOUT = "The current node timed out during startup. This could happen ..."  # Ray's startup error


@pytest.mark.parametrize(
    "cmdline, expected",
    [
        ([f"{RAY_DIR}/core/src/ray/gcs/gcs_server", "--log_dir=/tmp/ray/x"], True),
        (["/usr/bin/python3", "-u", f"{RAY_DIR}/_private/log_monitor.py"], True),
        (["ray::RolloutWorkerActor", "", ""], True),
        (["/usr/bin/python3", "-m", "pytest", "tests"], False),
        (["/usr/bin/python3", f"{RAY_DIR}-extras/tool.py"], False),  # a sibling folder, not Ray's
        ([], False),  # exited, or a kernel thread
    ],
)
def test_ray_processes_are_told_by_their_command_line(cmdline, expected):
    assert local.is_ray_process(cmdline, RAY_DIR) is expected


def _sleeper(*args: str) -> subprocess.Popen:
    """A child process that sleeps, returned once it has exec'd (its command line is its own); ``args``
    only shape that command line."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])
    while processes.cmdline(p.pid)[-1:] != p.args[-1:]:
        time.sleep(0.02)
    return p


def test_descendants_holds_children_and_grandchildren():
    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess,sys; subprocess.run(['sleep','30'])"],
    )
    try:
        deadline = time.monotonic() + 60  # a loaded host may take seconds to start the two
        while time.monotonic() < deadline:  # the grandchild first: it may appear between two readings
            grandchildren = processes.descendants(child.pid)
            found = processes.descendants()
            if grandchildren:
                break
            time.sleep(0.05)
        assert child.pid in found and grandchildren and grandchildren <= found
    finally:
        for pid in processes.descendants(child.pid):
            subprocess.run(["kill", "-9", str(pid)])
        child.kill()
        child.wait()


def test_only_the_ray_processes_started_since_the_snapshot_are_killed():
    old_ray = _sleeper(f"{RAY_DIR}/core/src/ray/gcs/gcs_server")  # Ray's, but there before the start
    before = processes.descendants()
    new_other, new_ray = _sleeper("--not-ray"), _sleeper(f"{RAY_DIR}/core/src/ray/raylet/raylet")
    try:
        assert local.kill_new_ray_processes(before, RAY_DIR) == [new_ray.pid]
        assert new_ray.wait(timeout=10) == -9
        assert old_ray.poll() is None and new_other.poll() is None
    finally:
        for p in (old_ray, new_other, new_ray):
            p.kill()
            p.wait()


def test_bad_arguments_are_refused_before_ray_starts():
    with pytest.raises(ValueError, match="num_attempts must be >= 1, got 0"):
        local.retry_ray_start(lambda: None, num_attempts=0)
    with pytest.raises(ValueError, match="pass no address"):
        local.start_local_ray(address="auto")


def test_the_runs_ray_start_is_tried_again_after_rays_startup_timeout(monkeypatch):
    """``init_ray`` (a run without ``runtime.ray_address``) goes through ``start_local_ray``: Ray's
    startup timeout, then a start that works."""
    import ray

    from moerl.runtime.ray import rollouts

    calls = []

    def init(**kwargs):
        calls.append(kwargs["address"])
        if len(calls) == 1:
            raise Exception(TIMEOUT)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(rollouts.torch, "set_num_threads", lambda n: None)
    rollouts.init_ray(load_config(None, ["runtime.mode=async"]))
    assert calls == ["local", "local"]


def test_other_errors_of_the_start_are_raised_at_once():
    calls = []

    def start():
        calls.append(1)
        raise RuntimeError("port 6379 in use")

    with pytest.raises(RuntimeError, match="port 6379"):
        local.retry_ray_start(start, num_attempts=3)
    assert calls == [1]


def test_every_attempt_timing_out_is_one_error_naming_the_start_with_rays_as_cause():
    def start():
        raise Exception(TIMEOUT)

    with pytest.raises(
        RuntimeError, match="the cluster failed: a raylet did not register .* in 2 start"
    ) as e:
        local.retry_ray_start(start, num_attempts=2, what="the cluster")
    assert str(e.value.__cause__) == TIMEOUT and "\n" not in str(e.value)


def test_ctrl_c_while_ray_fails_to_start_stops_the_run_without_another_start(monkeypatch):
    """A SIGINT held by ``init_ray`` during a start that times out: no further start, KeyboardInterrupt."""
    import ray

    from moerl.runtime.ray import rollouts

    calls = []

    def init(**kwargs):
        calls.append(kwargs["address"])
        os.kill(os.getpid(), signal.SIGINT)
        raise Exception(TIMEOUT)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    with pytest.raises(KeyboardInterrupt):
        rollouts.init_ray(load_config(None, ["runtime.mode=async"]))
    assert calls == ["local", "shutdown"]


def test_sigterm_during_the_start_kills_what_it_started_and_stops_the_run_as_ctrl_c(monkeypatch):
    """``ray.init`` installs a SIGTERM handler that exits (``sys.exit(15)``): a SIGTERM while Ray waits for
    its raylet abandons the start. What that start had spawned is killed, and ``init_ray`` stops the run
    as on Ctrl-C (KeyboardInterrupt) instead of exiting with 15."""
    import ray

    from moerl.runtime.ray import rollouts

    ray_dir = os.path.dirname(ray.__file__)
    spawned, calls = [], []

    def init(**kwargs):
        calls.append(kwargs["address"])
        spawned.append(_sleeper(f"{ray_dir}/core/src/ray/raylet/raylet"))
        raise SystemExit(signal.SIGTERM)  # what Ray's handler does

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    try:
        with pytest.raises(KeyboardInterrupt):
            rollouts.init_ray(load_config(None, ["runtime.mode=async"]))
        assert calls == ["local", "shutdown"]
        assert spawned[0].wait(timeout=10) == -9
    finally:
        for p in spawned:
            p.kill()
            p.wait()


def test_the_cli_says_a_failed_ray_start_in_one_line(monkeypatch, capfd, tmp_path):
    import moerl.train as controller
    from moerl.cli import main as cli_main
    from moerl.errors import RayStartError

    def train(cfg, **kwargs):
        raise RayStartError(
            "Ray's local start failed: a raylet did not register within Ray's 30 s in 3 starts"
        )

    monkeypatch.setattr(controller, "train", train)
    assert cli_main(["train", "--set", f"output_dir={tmp_path}"]) == 1
    err = capfd.readouterr().err.strip()
    assert err == "moerl: Ray's local start failed: a raylet did not register within Ray's 30 s in 3 starts"


def test_a_local_start_leaves_rays_token_banner_out_and_keeps_its_warnings(monkeypatch):
    """Issue 51: Ray >= 2.5x logs a three-line banner at every new local instance ("Token authentication is
    enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out ..."); ``start_local_ray`` drops
    that record only. The logger is Ray's own (a renamed module fails here, not silently)."""
    import ray
    from ray._private.authentication import authentication_token_setup as ray_auth

    assert ray_auth.logger.name == local.RAY_AUTH_LOGGER

    def init(**kwargs):  # what ray.init logs when it starts a local instance with the mode unset
        ray_auth._warn_token_auth_enabled()
        ray_auth._warn_token_auth_disabled()  # a security warning: kept

    class Records(logging.Handler):  # on Ray's logger itself: Ray's loggers need not propagate to root
        def emit(self, record):
            messages.append(record.getMessage())

    messages, handler = [], Records()
    monkeypatch.setattr(ray, "init", init)
    logging.getLogger(local.RAY_AUTH_LOGGER).addHandler(handler)
    try:
        local.start_local_ray(num_cpus=1)
        local.start_local_ray(num_cpus=1)  # idempotent: one filter
    finally:
        logging.getLogger(local.RAY_AUTH_LOGGER).removeHandler(handler)
    assert len(messages) == 2 and all("is disabled" in m for m in messages)
    assert logging.getLogger(local.RAY_AUTH_LOGGER).filters.count(local._is_not_auth_banner) == 1


class _FakeRay:
    """A stand-in ``ray`` module: ``is_initialized`` and ``shutdown`` only."""

    def __init__(self, up: bool):
        self.up, self.shutdowns = up, 0

    def is_initialized(self) -> bool:
        return self.up

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.up = False


@pytest.mark.parametrize("up_before", [False, True])
def test_a_run_shuts_down_only_the_ray_connection_it_made(monkeypatch, up_before):
    fake = _FakeRay(up_before)
    monkeypatch.setitem(sys.modules, "ray", fake)
    with local.stops_ray_it_started():
        fake.up = True  # the body connects (or finds it connected)
    assert fake.shutdowns == (0 if up_before else 1) and fake.up == up_before
    fake.up = False
    with pytest.raises(RuntimeError), local.stops_ray_it_started():  # also when the run fails
        fake.up = True
        raise RuntimeError("the run failed")
    assert fake.shutdowns == (1 if up_before else 2)


@pytest.mark.parametrize("tty, preset, expected", [(False, None, "0"), (True, None, None), (False, "1", "1")])
def test_worker_prefixes_without_colour_codes_where_stderr_is_no_terminal(
    monkeypatch, capsys, tty, preset, expected
):
    """``plain_worker_prefixes`` (called before every ``ray.init`` of a run): a log file gets the workers'
    ``(RolloutWorkerActor pid=...)`` lines as Ray's driver-side printer writes them, without ANSI codes;
    a terminal keeps Ray's colours, and a ``RAY_COLOR_PREFIX`` the user set wins."""
    from ray._private.worker import print_worker_logs

    from moerl.runtime.ray.rollouts import plain_worker_prefixes

    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    if preset is not None:
        monkeypatch.setenv("RAY_COLOR_PREFIX", preset)
    plain_worker_prefixes(type("Stream", (), {"isatty": lambda self: tty})())
    assert os.environ.get("RAY_COLOR_PREFIX") == expected
    line = {"pid": 4242, "ip": "h", "localhost": "h", "lines": ["reward function raised"], "is_err": True,
            "actor_name": "RolloutWorkerActor"}  # fmt: skip
    print_worker_logs(line, sys.stderr)
    err = capsys.readouterr().err
    assert "(RolloutWorkerActor pid=4242) reward function raised" in re.sub(r"\x1b\[[0-9;]*m", "", err)
    assert ("\x1b[" in err) == (expected != "0"), repr(err)
