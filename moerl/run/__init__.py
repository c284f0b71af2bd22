"""The run folder and what persists a run: the folder itself (``folder.py``), object-store mirroring
(``storage.py``), resume and trainer recovery, the checks before a run (``preflight.py``), the warm start,
and the run's interrupt handling (``interrupt.py``)."""
