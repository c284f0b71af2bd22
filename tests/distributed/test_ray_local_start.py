"""``start_local_ray``: Ray's fixed 30 s wait for its raylet running out (a loaded host) kills what that
attempt started and starts again; real Ray processes, in a subprocess of their own."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ray")

# The first attempt's raylet "does not register": Ray's own get_node fails once and Ray's clock in
# node.py jumps past the 30 s wait, so Ray raises its real startup Exception with its real processes up.
SCRIPT = textwrap.dedent(
    """
    import json, os, time, types
    import ray, ray._private.node as node, ray._private.services as services
    from moerl import processes
    from moerl.runtime.ray import local

    real_get_node, jump, first = services.get_node, [0.0], []

    def get_node(*a, **k):
        if not first:
            first.extend(processes.descendants())  # the first attempt's processes, all up by now
            jump[0] = 1000.0
            raise RuntimeError("node not registered (test)")
        return real_get_node(*a, **k)

    services.get_node = get_node
    node.time = types.SimpleNamespace(monotonic=lambda: time.monotonic() + jump[0], sleep=time.sleep)

    try:
        local.start_local_ray(num_attempts=int(os.environ["ATTEMPTS"]), num_cpus=1, include_dashboard=False,
                              configure_logging=False, log_to_driver=False)
        ok = ray.is_initialized() and ray.get(ray.remote(lambda: 7).remote()) == 7
    except RuntimeError as e:
        ok = f"{e} | cause: {e.__cause__}"
    print(json.dumps({"ok": ok, "first": len(first), "first_alive": [p for p in first if not processes.is_gone(p)]}))
    ray.shutdown()
    """
)


def _run(attempts: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, ATTEMPTS=str(attempts))
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240, env=env
    )


def test_a_start_that_times_out_is_cleaned_up_and_started_again():
    p = _run(attempts=3)  # the second start is real: a third if it too misses Ray's 30 s
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ok"], out
    assert out["first"] >= 2, out  # gcs_server and raylet at least: the failed attempt had started them
    assert out["first_alive"] == [], f"the failed attempt's processes still run: {out}; {p.stderr[-2000:]}"
    assert "Ray's local start timed out" in p.stderr and "starting again" in p.stderr


def test_the_last_attempt_kills_what_it_started_and_raises_one_line_with_rays_error_as_cause():
    p = _run(attempts=1)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert (
        "Ray's local start failed: a raylet did not register within Ray's 30 s in 1 start(s)" in out["ok"]
        and "cause: The current node timed out during startup" in out["ok"]
    ), out
    assert out["first"] >= 2 and out["first_alive"] == [], out
