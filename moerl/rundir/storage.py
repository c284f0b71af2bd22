"""Run storage: a run's files in an object store (``storage.url: s3://bucket/prefix``), no shared filesystem.

The trainer writes its run folder on local disk as always (``moerl.rundir.folder``); ``RunMirror``
copies it to ``<storage.url>/<run folder name>/`` as it goes, and the weight store writes its versions
there directly (``<run>/weights``, ``moerl.weights.store``), so rollout workers on other machines read
them from the store; the model folder the actors build their policy from is staged beside the
versions (``stage_model_folder``) and copied to each actor's machine (``local_model_folder``). ``fetch_run`` brings a stored run back to local disk for ``moerl train --resume
s3://...``.

    <storage.url>/<name>-<timestamp>/
        config.yaml, metrics.jsonl, ledger.jsonl      after every checkpoint (and at the end)
        checkpoints/step_N/...  + COMPLETE.json       the step folder's files, then its marker
        sft/...                 + COMPLETE.json       the SFT warm start (no init_from), once: a resume's
                                                      model, tokenizer and reference policy
        weights/vNNNNNNNN/...   + manifest.json       the weight store's own commit protocol
        weights/init/...        + COMPLETE.json       async runs: the model folder the actors build from
        policy/...              + COMPLETE.json       the exported policy (Hugging Face folder)
        report.png, summary.json                      at the end; summary.json last

What a reader may trust: one object PUT is atomic on S3 (a reader sees no object or all of it; a
multipart upload becomes visible when it completes), so a folder is committed by a marker object
uploaded after every file of it: ``COMPLETE.json`` lists each file's size and sha256. Readers
(``complete_checkpoints``, ``fetch_run``) ignore folders without a marker and check sizes and digests,
so an upload cut half-way is never read as a checkpoint. A marker is deleted before its folder is
replaced or pruned. Each upload, download, lookup and listing is tried ``storage.retries`` times
(exponential backoff, ``moerl.retry``) and then stops the run with a ``StorageError`` that names the file;
the local copy stays complete.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import fsspec

from moerl.config import RunConfig, load_config
from moerl.errors import StorageError  # noqa: F401 - re-exported: raised here
from moerl.retry import with_retries

MARKER = "COMPLETE.json"
RUN_FILES = ("config.yaml", "metrics.jsonl", "ledger.jsonl")
_STEP_DIR = re.compile(r"^step_(\d+)$")


def is_remote(url: str | None) -> bool:
    """Whether ``url`` names an object store or other non-local fsspec filesystem (``s3://``, ``memory://``)."""
    return bool(url) and "://" in url and not url.startswith("file://")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class DigestMismatchError(StorageError):
    """A downloaded file of a committed folder does not match the sha256 its marker lists (damaged in
    storage after the commit).

    Args:
        url: the storage's URL. rel: the folder. name: the file, relative to the folder.
    """

    def __init__(self, url: str, rel: str, name: str) -> None:
        super().__init__(f"storage: {url}/{rel}/{name} does not match its sha256 in {MARKER}")
        self.url, self.rel, self.name = url, rel, name


class RunStorage:
    """Files and committed folders under one fsspec URL, with retries.

    Args:
        url: ``s3://bucket/prefix``, ``memory://...`` or a local folder.
        options: fsspec options of the filesystem (s3fs: ``endpoint_url``, ``client_kwargs``, ``profile``).
        retries: attempts of each operation (>= 1).
        backoff_s: wait before the second attempt, doubled after each failure.
    """

    def __init__(self, url: str, *, options: dict | None = None, retries: int = 3, backoff_s: float = 0.5):
        self.url = url.rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(self.url, **(options or {}))
        self.root = root.rstrip("/")
        self.retries = max(1, retries)
        self.backoff_s = backoff_s

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def _retry(self, what: str, fn):
        return with_retries(what, fn, attempts=self.retries, backoff_s=self.backoff_s)

    # -- files -------------------------------------------------------------------------------------

    def put_file(self, local: Path, rel: str) -> None:
        """Upload ``local`` as ``rel`` and check the stored size (one object: atomic for readers)."""
        size = local.stat().st_size

        def upload():
            self.fs.put_file(str(local), self._path(rel))
            self.fs.invalidate_cache(self._path(rel))
            stored = self.fs.info(self._path(rel))["size"]
            if stored != size:
                raise OSError(f"stored {stored} bytes of {size}")

        self._retry(f"upload of {local} to {self.url}/{rel}", upload)

    def get_file(self, rel: str, local: Path) -> None:
        """Download ``rel`` to ``local`` (through a temp file and a rename)."""
        tmp = local.with_name(f".{local.name}.part")
        self._retry(f"download of {self.url}/{rel}", lambda: self.fs.get_file(self._path(rel), str(tmp)))
        tmp.replace(local)

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists (fresh listing, no cache)."""
        self.fs.invalidate_cache()
        return self._retry(f"lookup of {self.url}/{rel}", lambda: self.fs.exists(self._path(rel)))

    def remove(self, rel: str, *, recursive: bool = False) -> None:
        """Delete ``rel`` (a missing one is fine)."""
        try:
            self._retry(
                f"delete of {self.url}/{rel}", lambda: self.fs.rm(self._path(rel), recursive=recursive)
            )
        except FileNotFoundError:
            pass

    # -- committed folders -------------------------------------------------------------------------

    def put_tree(self, local_dir: Path, rel: str) -> None:
        """Upload every file under ``local_dir`` as ``rel/...``, then the marker that commits it."""
        self.remove(f"{rel}/{MARKER}")  # a replaced folder is uncommitted while it changes
        files = {}
        for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            name = path.relative_to(local_dir).as_posix()
            self.put_file(path, f"{rel}/{name}")
            files[name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
        with tempfile.TemporaryDirectory() as tmp:
            marker = Path(tmp) / MARKER
            marker.write_text(json.dumps({"files": files, "committed_at": time.time()}, sort_keys=True))
            self.put_file(marker, f"{rel}/{MARKER}")

    def committed_files(self, rel: str) -> dict[str, dict] | None:
        """The file list of the committed folder ``rel`` if its marker is there and every listed file
        has its size; None otherwise (never committed, being replaced, or damaged)."""
        self.fs.invalidate_cache()
        try:
            marker = json.loads(
                self._retry(
                    f"read of {self.url}/{rel}/{MARKER}",
                    lambda: self.fs.cat_file(self._path(f"{rel}/{MARKER}")),
                )
            )
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        for name, entry in marker["files"].items():
            path = self._path(f"{rel}/{name}")
            try:
                info = self._retry(f"lookup of {self.url}/{rel}/{name}", lambda p=path: self.fs.info(p))
            except FileNotFoundError:
                return None
            if info["size"] != entry["size"]:
                return None
        return marker["files"]

    def get_tree(self, rel: str, local_dir: Path) -> None:
        """Download the committed folder ``rel`` into ``local_dir`` (created whole: a temp folder renamed),
        checking each file's sha256.

        Raises:
            FileNotFoundError: ``rel`` is not a committed folder.
            StorageError: a download failed; ``DigestMismatchError``: a file's digest does not match its marker.
        """
        files = self.committed_files(rel)
        if files is None:
            raise FileNotFoundError(f"{self.url}/{rel} is not a complete folder (no {MARKER})")
        local_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{local_dir.name}.part-", dir=local_dir.parent))
        try:
            for name, entry in files.items():
                target = tmp / name
                target.parent.mkdir(parents=True, exist_ok=True)
                self.get_file(f"{rel}/{name}", target)
                if _sha256(target) != entry["sha256"]:
                    raise DigestMismatchError(self.url, rel, name)
            tmp.chmod(0o755)
            tmp.rename(local_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def complete_checkpoints(self, run_rel: str = "") -> list[tuple[int, str]]:
        """Committed checkpoints of the run at ``run_rel`` as ``(step, rel)``, ascending by step."""
        prefix = f"{run_rel}/checkpoints" if run_rel else "checkpoints"
        self.fs.invalidate_cache()
        try:
            listed = self._retry(
                f"listing of {self.url}/{prefix}", lambda: self.fs.ls(self._path(prefix), detail=False)
            )
        except FileNotFoundError:
            return []
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in listed]
        steps = sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.match(n)))
        return [
            (s, f"{prefix}/step_{s}") for s in steps if self.committed_files(f"{prefix}/step_{s}") is not None
        ]


class RunMirror:
    """Keeps ``<storage.url>/<run folder name>/`` a copy of a local run folder (module docstring).

    Args:
        storage: the run's own location (``RunStorage`` of ``<storage.url>/<run folder name>``).
        run_path: the local run folder.
        keep_checkpoints: committed checkpoints kept in storage (newest by step).
    """

    def __init__(self, storage: RunStorage, run_path: Path, *, keep_checkpoints: int = 2) -> None:
        self.storage = storage
        self.run_path = Path(run_path)
        self.keep_checkpoints = keep_checkpoints

    @classmethod
    def from_config(cls, cfg: RunConfig, run_path: Path) -> RunMirror | None:
        """The mirror of the run at ``run_path`` when ``storage.url`` is remote, else None."""
        if not is_remote(cfg.storage.url):
            return None
        url = f"{cfg.storage.url.rstrip('/')}/{Path(run_path).name}"
        storage = RunStorage(url, options=cfg.storage.options, retries=cfg.storage.retries)
        return cls(storage, run_path, keep_checkpoints=cfg.runtime.keep_checkpoints)

    @property
    def url(self) -> str:
        """The run's URL in storage (what ``moerl train --resume`` takes)."""
        return self.storage.url

    @property
    def weights_url(self) -> str:
        """Where the run's weight store writes its versions."""
        return f"{self.storage.url}/weights"

    def sync_files(self) -> None:
        """Upload ``config.yaml``, ``metrics.jsonl`` and ``ledger.jsonl`` as they are now."""
        for name in RUN_FILES:
            if (self.run_path / name).is_file():
                self.storage.put_file(self.run_path / name, name)

    def warm_start(self, folder: Path) -> None:
        """Upload the run's SFT warm-start folder as ``sft/`` unless it is committed there already: a
        resume on another machine builds its model, tokenizer and reference policy from it instead of
        running the warm start again."""
        if self.storage.committed_files("sft") is None:
            self.storage.put_tree(Path(folder), "sft")

    def checkpoint(self, step: int) -> None:
        """After the local checkpoint of ``step``: upload the run files and the checkpoint folder (marker
        last), then prune older committed checkpoints beyond ``keep_checkpoints`` (marker first)."""
        self.sync_files()
        self.storage.put_tree(self.run_path / "checkpoints" / f"step_{step}", f"checkpoints/step_{step}")
        for _, rel in self.storage.complete_checkpoints()[: -self.keep_checkpoints]:
            self.storage.remove(f"{rel}/{MARKER}")
            self.storage.remove(rel, recursive=True)

    def finish(self) -> None:
        """At the end of the run: run files, the exported policy, the report, then ``summary.json``."""
        self.sync_files()
        if (self.run_path / "policy").is_dir():
            self.storage.put_tree(self.run_path / "policy", "policy")
        if (self.run_path / "report.png").is_file():
            self.storage.put_file(self.run_path / "report.png", "report.png")
        if (self.run_path / "summary.json").is_file():
            self.storage.put_file(self.run_path / "summary.json", "summary.json")


def fetch_run(url: str, local_parent: str | Path, *, options: dict | None = None, retries: int = 3) -> Path:
    """Bring the stored run at ``url`` to ``<local_parent>/<run folder name>`` for a resume: its run
    files, ``summary.json`` if any, its SFT warm start ``sft/`` if stored, and its newest committed
    checkpoint whose files match their sha256 (a newer damaged one is skipped with one line on stderr).
    The copy is made in a temp folder renamed at the end: a failed fetch leaves nothing.

    Raises:
        FileNotFoundError: no ``config.yaml`` at ``url`` (not a stored run).
        FileExistsError: the local folder already exists (resume from it directly, or remove it).
        StorageError: a download failed after its retries, a file of the SFT warm start does not match its
            digest, or no committed checkpoint does.
    """
    storage = RunStorage(url, options=options, retries=retries)
    local = Path(local_parent) / storage.url.rsplit("/", 1)[-1]
    if not storage.exists("config.yaml"):
        raise FileNotFoundError(f"{storage.url} is not a stored run (no config.yaml)")
    if local.exists():
        raise FileExistsError(
            f"{local} exists; resume from it (moerl train --resume {local}) or remove it first"
        )
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{local.name}.part-", dir=local.parent))
    try:
        for name in (*RUN_FILES, "summary.json"):
            if storage.exists(name):
                storage.get_file(name, tmp / name)
        if storage.committed_files("sft") is not None:  # no SFT warm start again on this machine
            storage.get_tree("sft", tmp / "sft")
        _fetch_newest_good_checkpoint(storage, tmp / "checkpoints")
        tmp.chmod(0o755)
        tmp.rename(local)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return local


def _fetch_newest_good_checkpoint(storage: RunStorage, local: Path) -> None:
    """Download the newest committed checkpoint whose files match their sha256 into ``local/step_N``;
    a newer one damaged in storage is skipped with one line on stderr, as a damaged local checkpoint is
    (``moerl.run.resume.resume_checkpoint``). No committed checkpoint: nothing is fetched (the
    resume then says why it has none).

    Raises:
        StorageError: a download failed after its retries, or every committed checkpoint is damaged.
    """
    skipped = []
    found = storage.complete_checkpoints()
    for step, rel in reversed(found):
        try:
            storage.get_tree(rel, local / f"step_{step}")
        except DigestMismatchError as e:
            skipped.append(f"{storage.url}/{rel}: {e.name} does not match its sha256 in {MARKER}")
            continue
        for line in skipped:
            print(f"moerl: {line}; resuming from step_{step}", file=sys.stderr)
        return
    if skipped:
        raise StorageError(f"storage: no checkpoint of {storage.url} is undamaged: {'; '.join(skipped)}")


def use_local_storage(cfg: RunConfig) -> None:
    """A local ``storage.url`` is simply where run folders go: it becomes ``output_dir``."""
    if cfg.storage.url is not None and not is_remote(cfg.storage.url):
        cfg.output_dir = cfg.storage.url.removeprefix("file://")


def fetch_for_resume(url: str, overrides: list[str] | None) -> Path:
    """``fetch_run`` with the storage options, retries and ``output_dir`` of the resume's ``--set``
    overrides (the stored config cannot be read before the options are known)."""
    base = load_config(None, overrides)
    return fetch_run(url, base.output_dir, options=base.storage.options, retries=base.storage.retries)


STAGED_MODEL = "init"
"""Name of the staged model folder beside the weight versions (``<store_url>/init``)."""
_LOCAL_COPIES: dict[str, str] = {}  # staged URL -> local copy, one download per process


def stage_model_folder(path: str | None, store_url: str, options: dict | None = None) -> str | None:
    """Where actors on other machines find the model folder ``path`` (the policy the workers build
    before loading weight versions, with its tokenizer): uploaded as a committed folder to
    ``<store_url>/init`` when the weight store is remote, so no filesystem is shared; ``path`` itself
    when the store is local, ``path`` is None or already a URL.

    Raises:
        StorageError: the upload failed after its retries.
    """
    if path is None or not is_remote(store_url) or is_remote(path):
        return path
    RunStorage(store_url, options=options).put_tree(Path(path), STAGED_MODEL)
    return f"{store_url.rstrip('/')}/{STAGED_MODEL}"


def local_model_folder(path: str | None, options: dict | None = None) -> str | None:
    """A local folder for ``path``: itself, or for a staged URL (``stage_model_folder``) a local copy,
    downloaded once per process into a temp folder and checked against its marker's sha256.

    Raises:
        FileNotFoundError: nothing committed at the URL.
        StorageError: a download failed or a file does not match its digest.
    """
    if path is None or not is_remote(path):
        return path
    if path not in _LOCAL_COPIES:
        parent, name = path.rstrip("/").rsplit("/", 1)
        target = Path(tempfile.mkdtemp(prefix="moerl-model-")) / name
        RunStorage(parent, options=options).get_tree(name, target)
        _LOCAL_COPIES[path] = str(target)
    return _LOCAL_COPIES[path]
