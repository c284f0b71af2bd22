"""What persists or checks a whole run, at the top of the layers (only the commands sit above): resume and
trainer recovery, the checks before a run (``preflight.py``), the warm start, reward-error watching and
the run's interrupt handling (``interrupt.py``). The run folder itself and its object-store mirror are
``moerl.rundir`` (a low layer the runtime and telemetry use; they never import this package)."""
