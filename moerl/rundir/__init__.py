"""The run folder and its copy in object storage, the low layer every part of a run writes through:
``folder.py`` (config, metrics, ledger, summary, checkpoints' place; rewind on resume; ``run.lock``) and
``storage.py`` (``storage.url``: the folder mirrored to S3, fetched back for a resume, model folders
staged for remote workers). Below the trainer, the runtime and telemetry, which read and write them; what
persists or checks a whole run (resume, recovery, preflight, warm start, interrupts) is ``moerl.run``,
at the top."""
