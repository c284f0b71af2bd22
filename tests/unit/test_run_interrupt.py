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
