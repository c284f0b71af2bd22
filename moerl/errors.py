"""Errors that the ``moerl`` command turns into one line (kept free of heavy imports: the CLI loads it
before any subcommand runs)."""


class StorageError(OSError):
    """An upload or download of run storage failed after its retries (``moerl.runtime.storage``); the
    message is one line naming the file."""
