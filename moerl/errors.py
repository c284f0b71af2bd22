"""Errors that the ``moerl`` command turns into one line (kept free of heavy imports: the CLI loads it
before any subcommand runs)."""


class StorageError(OSError):
    """An upload or download of run storage failed after its retries (``moerl.runtime.storage``); the
    message is one line naming the file."""


class RunFolderInUseError(RuntimeError):
    """Another process holds a run folder's lock (``moerl.runtime.run_dir.RunFolderLock``): a second run or
    resume of it would rewind or overwrite what the live one writes. The message is one line naming the
    folder and the holder's pid."""
