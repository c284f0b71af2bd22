"""Ctrl-C / SIGTERM of a run: the first stops it, later ones are ignored with one line (real signals)."""

from __future__ import annotations

import os
import signal

import pytest

from moerl.cli import main as cli_main
from moerl.run.interrupt import sigterm_interrupts


@pytest.fixture
def restored_handlers():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield before
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_a_second_interrupt_during_the_shutdown_is_ignored(first, restored_handlers, capfd):
    shut_down = []
    with pytest.raises(KeyboardInterrupt), sigterm_interrupts():
        try:
            os.kill(os.getpid(), first)
            signal.pause()  # not reached: the handler raises on delivery
        finally:  # the run's shutdown: both signals again, neither interrupts it
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            shut_down.append(True)
    assert shut_down == [True]
    assert capfd.readouterr().err.count("moerl: already stopping") == 2
    for sig, handler in restored_handlers.items():  # the run's handlers are gone after it
        assert signal.getsignal(sig) is handler


def test_the_cli_keeps_ignoring_interrupts_for_the_exit(monkeypatch, restored_handlers, capfd, tmp_path):
    import moerl.train as controller

    def interrupted(cfg, live=True):
        raise controller.RunInterrupted(tmp_path / "runs" / "default-1", resumable=True)

    monkeypatch.setattr(controller, "train", interrupted)
    assert cli_main(["train", "--set", f"output_dir={tmp_path}"]) == 130
    os.kill(os.getpid(), signal.SIGINT)  # as during Ray's shutdown at exit: no KeyboardInterrupt
    err = capfd.readouterr().err
    assert "continue with: moerl train --resume" in err and "moerl: already stopping" in err


def test_an_interrupt_before_the_first_step_says_nothing_can_be_resumed(
    monkeypatch, restored_handlers, capfd
):
    import moerl.train as controller

    def interrupted(cfg, live=True):  # e.g. Ctrl-C in the warm start: RunInterrupted.of a removed folder
        raise controller.RunInterrupted(None, resumable=False)

    monkeypatch.setattr(controller, "train", interrupted)
    assert cli_main(["train"]) == 130
    err = capfd.readouterr().err.strip().splitlines()
    assert (
        err[-1]
        == "moerl: interrupted before the first training step: nothing to resume (the run folder was removed)"
    )


def test_ctrl_c_while_ray_starts_is_held_until_it_is_up_then_ray_stops(monkeypatch):
    """``init_ray``: a SIGINT that arrives inside ``ray.init`` (Ray half started: processes that would
    outlive the run) does not cut it short; once it returns, Ray is shut down and KeyboardInterrupt
    raised; the process's own SIGINT handler is back."""

    import ray

    from moerl.config import load_config
    from moerl.runtime.ray import rollouts

    calls = []

    def init(**kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the start
        calls.append("init finished")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        rollouts.init_ray(load_config(None, ["runtime.mode=async"]))
    assert calls == ["init finished", "shutdown"]
    assert signal.getsignal(signal.SIGINT) is before
