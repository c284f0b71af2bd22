"""Full-run checkpoints: atomic step folders of named parts, tensors in safetensors, the rest in JSON.

Layout::

    <run_dir>/checkpoints/step_120/
        meta.json                 {"format", "step", "parts", "created_at", "files", "sharded_files"}
        model.json                the part's structure; each tensor replaced by {"__tensor__": key}
        model.safetensors         the part's tensors (only if it has any)
        optimizer.json / optimizer.safetensors, rng.json / rng.safetensors, queue.json, ...
    <run_dir>/checkpoints/shards/step_120/   a trainer group's DCP folder (the part ``sharded`` names it)

``meta.json``'s ``files`` maps each other file of the step folder to ``{"size": bytes, "xxh3_128": hex}``;
``sharded_files`` does the same for every file of the DCP folder a ``sharded`` part names (its
``.metadata`` and ``__<rank>_<n>.distcp`` shards, keyed by their path inside that folder). meta.json is
written last, inside the temporary folder, so the records are as atomic as the files they describe.
``checkpoint_problem`` checks them: a tensor file changed after the write (a flipped byte, a script that
re-saved ``model.safetensors`` with other values) is a damaged checkpoint, skipped on resume like one cut
short. The digest is xxh3-128 (``xxhash``, already used for weight buckets), not sha256: it runs at
memory speed (about 24 GB/s on one core here, sha256 about 2 GB/s), so a resume and a trainer recovery
check every byte at little cost, and 128 bits make an accidental match negligible. It is no defence
against a deliberate edit (whoever can rewrite a tensor file can rewrite meta.json too). A checkpoint
written before digests were recorded has no ``files``: its sizes and digests are not checked, it loads
as before; the format string stays ``moerl-checkpoint/1`` because the records only add keys that readers
of that format ignore.

A part is any nesting of dicts, lists, tuples, ``str``/``int``/``float``/``bool``/``None``, torch tensors and
numpy arrays; dicts with non-string keys (an optimizer's ``state``) and tuples (``random.getstate()``,
AdamW ``betas``) round-trip exactly. Nothing is pickled: loading cannot run code.

Atomicity: the folder is written as ``checkpoints/step_N.tmp-XXXX`` (files fsynced) and renamed to
``step_N`` only when complete, so a crash mid-write never leaves a visible ``step_N``; leftovers of crashed
writes are removed by the next ``save_checkpoint``. The newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

_FORMAT = "moerl-checkpoint/1"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PART_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_MARKERS = ("__tensor__", "__tuple__", "__dict__", "__ndarray__")
_DIGEST = "xxh3_128"  # the key of a file record's digest in meta.json (see the module docstring)


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able form of ``obj``; tensors are moved into ``tensors`` under unique keys."""
    if isinstance(obj, torch.Tensor):
        key = path or "tensor"
        while key in tensors:
            key += "_"
        t = obj.detach().to("cpu").contiguous()
        # a view of a larger storage would save the whole storage: save a private copy.
        tensors[key] = t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(m in obj for m in _MARKERS):
            return {k: _encode(v, f"{path}.{k}" if path else k, tensors) for k, v in obj.items()}
        return {
            "__dict__": [
                [_encode(k, f"{path}.key", tensors), _encode(v, f"{path}.{k}", tensors)]
                for k, v in obj.items()
            ]
        }
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    raise TypeError(
        f"checkpoint: cannot store {type(obj).__name__} at '{path}'; use tensors, arrays, dicts, lists, scalars"
    )


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return np.asarray(obj["__ndarray__"], dtype=obj["dtype"])
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__dict__" in obj:
        return {_decode_key(k, tensors): _decode(v, tensors) for k, v in obj["__dict__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def _decode_key(key: Any, tensors: dict[str, torch.Tensor]) -> Any:
    value = _decode(key, tensors)
    return tuple(value) if isinstance(value, list) else value  # keys must be hashable


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_part(folder: Path, name: str, part: Any) -> None:
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(part, "", tensors)
    seen: set[int] = set()
    for key, t in tensors.items():  # safetensors refuses tensors sharing storage (tied weights)
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            tensors[key] = t.clone()
        seen.add(ptr)
    if tensors:
        save_file(tensors, str(folder / f"{name}.safetensors"))
        with open(folder / f"{name}.safetensors", "rb+") as f:
            os.fsync(f.fileno())
    _write_synced(folder / f"{name}.json", json.dumps(encoded).encode())


def _file_record(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "xxh3_128": hex digest}`` of the file ``path``, read in 4 MiB blocks."""
    digest, size = xxhash.xxh3_128(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
            size += len(block)
    return {"size": size, _DIGEST: digest.hexdigest()}


def _folder_records(folder: Path) -> dict[str, dict[str, Any]]:
    """The record (``_file_record``) of every file under ``folder``, keyed by its POSIX path inside it."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {p.relative_to(folder).as_posix(): _file_record(p) for p in files}


def _sharded_folder(checkpoints: Path, part: Any) -> Path | None:
    """The DCP folder a ``sharded`` part (``{"path": "shards/step_N", ...}``) names, or None."""
    if isinstance(part, dict) and isinstance(part.get("path"), str):
        return checkpoints / part["path"]
    return None


def _records_problem(folder: Path, records: Any, label: str) -> str | None:
    """The first file of ``folder`` whose size or digest differs from its meta.json record, in one line
    (``label``: how the message names the folder's files, e.g. ``"shards/step_2/"``); sizes are checked
    first (a stat each), then digests (every byte read)."""
    if not isinstance(records, dict) or not all(
        isinstance(r, dict) and isinstance(r.get("size"), int) for r in records.values()
    ):
        return f"meta.json has unreadable file records for {label or 'the step folder'}"
    for name, record in records.items():
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            return f"{label}{name} missing (meta.json records it)"
        except OSError as e:
            return f"{label}{name} unreadable ({e.strerror or e})"
        if size != record["size"]:
            return (
                f"{label}{name} is {size} bytes, meta.json records {record['size']} (changed after the write)"
            )
    for name, record in records.items():
        want = record.get(_DIGEST)
        if not isinstance(want, str):
            continue  # a record without this digest: the size was all there was to check
        try:
            got = _file_record(folder / name)[_DIGEST]
        except OSError as e:  # a folder in its place, no read permission
            return f"{label}{name} unreadable ({e.strerror or e})"
        if got != want:
            return (
                f"{label}{name} does not match its {_DIGEST} digest in meta.json (written {want[:16]}, "
                f"now {got[:16]}): changed after the checkpoint was written"
            )
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as ``(step, folder)``, ascending by step."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(run_dir: str | Path, *, contents: bool = True) -> Path | None:
    """Folder of the newest complete checkpoint of ``run_dir`` (``checkpoint_problem`` finds nothing
    wrong with it), or ``None`` if there is none; ``contents`` as in ``checkpoint_problem``."""
    return newest_complete_checkpoint(run_dir, contents=contents)[0]


def newest_complete_checkpoint(
    run_dir: str | Path, *, contents: bool = True
) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint folder of ``run_dir`` (or ``None``) and, for each newer step
    folder skipped on the way, one line ``"checkpoints/step_200: model.safetensors unreadable (...)"``.

    With ``contents`` it reads every byte of the folders it checks once (``checkpoint_problem``: xxh3
    digests, at about disk speed): meant for a resume or a recovery, not for a loop; ``list_checkpoints``
    reads no file. ``contents=False`` checks the structure only (headers and JSON).
    """
    skipped = []
    for _, path in reversed(list_checkpoints(run_dir)):
        problem = checkpoint_problem(path, contents=contents)
        if problem is None:
            return path, skipped
        skipped.append(f"{path.parent.name}/{path.name}: {problem}")
    return None, skipped


def checkpoint_problem(path: str | Path, *, contents: bool = True) -> str | None:
    """What makes the step folder ``path`` an incomplete or damaged checkpoint (e.g. ``"meta.json
    missing"``, ``"optimizer.safetensors missing"``, ``"model.safetensors unreadable (invalid header
    length)"``, ``"model.safetensors does not match its xxh3_128 digest in meta.json (written ..., now
    ...): changed after the checkpoint was written"``), or ``None`` when every file it needs is there,
    readable and as written.

    First the structure: ``meta.json``, each part's JSON and each safetensors header (safetensors checks
    that the header's offsets cover the file exactly, so a file cut short is caught); a part ``sharded``
    (a trainer group's DCP folder) must have a readable ``.metadata`` (DCP writes it last) and every
    shard file it names. Then the contents: each file's size and xxh3-128 digest against meta.json's
    ``files`` and ``sharded_files`` (every byte is read once; no tensor is built). A checkpoint written
    before digests were recorded has no records: only its structure is checked. ``contents=False``
    skips the sizes and digests (a process asking whether the checkpoint it has just written exists, as
    an interrupted run does before it exits).
    """
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        return "meta.json missing"
    except (OSError, ValueError) as e:
        return f"meta.json unreadable ({e})"
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT or not isinstance(meta.get("parts"), list):
        return f"meta.json is not a {_FORMAT} record"
    for name in meta["parts"]:
        problem = _part_problem(path, str(name))
        if problem is not None:
            return problem
    if not contents:
        return None
    if "files" in meta and (problem := _records_problem(path, meta["files"], "")) is not None:
        return problem
    if "sharded_files" in meta and "sharded" in meta["parts"]:
        folder = _sharded_folder(path.parent, json.loads((path / "sharded.json").read_text()))
        if folder is not None:
            rel = f"{folder.parent.name}/{folder.name}/"
            return _records_problem(folder, meta["sharded_files"], rel)
    return None


def _part_problem(path: Path, name: str) -> str | None:
    """What is wrong with the part ``name`` of the checkpoint folder ``path`` (``checkpoint_problem``)."""
    try:
        encoded = json.loads((path / f"{name}.json").read_text())
    except FileNotFoundError:
        return f"{name}.json missing"
    except (OSError, ValueError) as e:
        return f"{name}.json unreadable ({e})"
    wanted = _tensor_keys(encoded)
    tensor_file = path / f"{name}.safetensors"
    if wanted:
        if not tensor_file.is_file():
            return f"{tensor_file.name} missing"
        try:
            with safe_open(str(tensor_file), framework="pt") as f:
                have = set(f.keys())
        except (SafetensorError, OSError) as e:
            return f"{tensor_file.name} unreadable ({str(e).rsplit(': ', 1)[-1]})"
        if missing := sorted(wanted - have):
            return f"{tensor_file.name} lacks {len(missing)} tensor(s) of {name}.json, e.g. {missing[0]!r}"
    if name == "sharded" and (folder := _sharded_folder(path.parent, encoded)) is not None:
        return _sharded_problem(folder)
    return None


def _tensor_keys(encoded: Any) -> set[str]:
    """The safetensors keys an encoded part refers to (its ``{"__tensor__": key}`` leaves)."""
    if isinstance(encoded, list):
        return set().union(*(_tensor_keys(v) for v in encoded))
    if isinstance(encoded, dict):
        if isinstance(encoded.get("__tensor__"), str):
            return {encoded["__tensor__"]}
        return set().union(*(_tensor_keys(v) for v in encoded.values()))
    return set()


def _sharded_problem(folder: Path) -> str | None:
    """What is wrong with a DCP folder: no readable ``.metadata``, or a shard file it names missing."""
    rel = f"{folder.parent.name}/{folder.name}"
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except FileNotFoundError:
        return f"{rel}/.metadata missing (shards not written completely)"
    except Exception as e:  # noqa: BLE001 - an unpickling error of any kind: the file is damaged
        return f"{rel}/.metadata unreadable ({type(e).__name__})"
    files = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
    for file in sorted(f for f in files if f):
        if not (folder / file).is_file():
            return f"{rel}/{file} missing"
    return None


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], *, keep: int = 3) -> Path:
    """Write ``state`` atomically as ``<run_dir>/checkpoints/step_<step>`` and keep the newest ``keep``.

    Args:
        run_dir: run folder.
        step: trainer step the state belongs to (>= 0); an existing checkpoint of that step is replaced.
        state: named parts, e.g. ``{"model": model.state_dict(), "optimizer": opt.state_dict(),
            "rng": capture_rng_state(), "queue": queue.state_dict(), "trainer": {"step": 120}}``.
        keep: complete checkpoints kept (>= 1), newest by step.

    A part ``sharded`` (``{"path": "shards/step_N", ...}``, relative to ``<run_dir>/checkpoints``) names
    a DCP folder written before this call; its files' sizes and digests are recorded too (read once here).

    Returns:
        The checkpoint folder.

    Raises:
        ValueError: bad ``step``/``keep``, or a part name outside ``[A-Za-z0-9_.-]``.
        TypeError: a value of a type that cannot be stored (the message gives its path in the state).
    """
    if step < 0 or keep < 1:
        raise ValueError(f"save_checkpoint: step={step} must be >= 0 and keep={keep} >= 1")
    for name in state:
        if not isinstance(name, str) or not _PART_NAME.match(name) or name == "meta":
            raise ValueError(
                f"save_checkpoint: part name {name!r} must match [A-Za-z0-9_.-]+ and not be 'meta'"
            )
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob("step_*.tmp-*"):  # a crashed earlier write (single writer per run)
        shutil.rmtree(leftover, ignore_errors=True)
    final = root / f"step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f"step_{step}.tmp-", dir=root))
    tmp.chmod(0o755)  # mkdtemp creates 0700; a checkpoint is read by other users and tools too
    try:
        for name, part in state.items():
            _write_part(tmp, name, part)
        meta = {"format": _FORMAT, "step": step, "parts": list(state), "created_at": time.time()}
        meta["files"] = _folder_records(tmp)  # before meta.json exists: it is not one of them
        if (shards := _sharded_folder(root, state.get("sharded"))) is not None and shards.is_dir():
            meta["sharded_files"] = _folder_records(shards)  # written by the ranks before this call
        _write_synced(tmp / "meta.json", json.dumps(meta, indent=1).encode())
        _fsync_dir(tmp)
        if final.exists():
            old = root / f"step_{step}.tmp-old-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old_path in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old_path, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path, *, contents: bool = True) -> dict[str, Any]:
    """Read a checkpoint folder (e.g. from ``latest_checkpoint``) back into its named parts.

    Tensors come back on CPU with their saved dtypes; the step is ``read_checkpoint_step(path)``.
    ``contents=False``: the caller picked ``path`` with ``latest_checkpoint`` / ``newest_complete_checkpoint``,
    which read every byte for its digest already; only the structure is checked again (``checkpoint_problem``).

    Raises:
        FileNotFoundError: ``path`` is not a checkpoint folder (no ``meta.json``).
        ValueError: unknown checkpoint format, or a damaged checkpoint (``checkpoint_problem`` says what:
            a file missing, unreadable, or changed since the write; every byte is read for its digest).
    """
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint folder (no meta.json)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != _FORMAT:
        raise ValueError(
            f"{meta_path}: unknown checkpoint format {meta.get('format')!r}; expected {_FORMAT!r}"
        )
    if (problem := checkpoint_problem(path, contents=contents)) is not None:  # one line, no deep traceback
        raise ValueError(f"{path} is not a complete checkpoint: {problem}")
    state = {}
    for name in meta["parts"]:
        tensor_file = path / f"{name}.safetensors"
        tensors = load_file(str(tensor_file)) if tensor_file.exists() else {}
        state[name] = _decode(json.loads((path / f"{name}.json").read_text()), tensors)
    return state


def read_checkpoint_step(path: str | Path) -> int:
    """The trainer step recorded in a checkpoint folder's ``meta.json``."""
    return int(json.loads((Path(path) / "meta.json").read_text())["step"])


def capture_rng_state() -> dict[str, Any]:
    """Python ``random``, numpy's global and torch's CPU (and every CUDA device's) RNG states, storable."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng_state`` (after a save/load round trip)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    for i, cuda_state in enumerate(state.get("cuda", [])):
        torch.cuda.set_rng_state(cuda_state, i)
