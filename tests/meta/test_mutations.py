"""Mutation check: the suite catches a feature removed. Each mutation is a small source edit applied to a
scratch copy of the repository (the files ``git ls-files`` lists); the few test files that must catch it
run there (``pytest -x -q`` in a process of its own that imports the copy's moerl, forked from a job server
that imported torch once: ``_JobServer``) and must fail. The same tests run once on an unmutated copy and must pass, so a failure is the mutation's.

A mutation is ``(file, old text, new text)``: when the code under it is reworked, the old text is checked
first and a drift fails with a line naming the mutation (update ``MUTATIONS``), never silently passes.

The repository is copied once (its Python files compiled there once); each job gets a hard-linked clone
of that copy, in which a mutated file is a new file (the copy and the other clones keep the original)
with its stale bytecode removed.
"""

from __future__ import annotations

import compileall
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from moerl.processes import is_gone

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


@dataclass(frozen=True)
class Mutation:
    """``old`` replaced by ``new`` in ``file`` (repository-relative; ``old`` must occur exactly once);
    ``tests`` are the node ids of the tests that must catch it (a renamed test is a clear error)."""

    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "activation checkpointing off (each layer called plainly, no recompute)",
        "moerl/models/model.py",
        "x, s = checkpoint(layer, x, cos, sin, mask, cache, token_mask, forced, use_reentrant=False)",
        "x, s = layer(x, cos, sin, mask, cache, token_mask, forced)",
        ("tests/unit/test_trainer.py::test_activation_checkpointing_recomputes_every_layer_in_backward",),
    ),
    Mutation(
        "weight-bucket checksum skipped",
        "moerl/weights/buckets.py",
        "        digest = bucket_digest(bucket.entries, bucket.data)\n        if digest != bucket.checksum:",
        "        digest = bucket_digest(bucket.entries, bucket.data)\n        if False:",
        (
            "tests/unit/test_weight_sync.py::test_pack_unpack_roundtrip_and_checksum_catches_corruption",
            "tests/unit/test_weight_sync.py::test_assembler_drops_a_version_with_a_corrupt_or_misfiled_bucket",
        ),
    ),
    Mutation(
        "staleness admission off (every group admitted at put)",
        "moerl/runtime/buffer.py",
        "        if group.min_policy_version < version - self.max_staleness:",
        "        if False:",
        (
            "tests/unit/test_buffer.py::test_staleness_admission_at_put_drop",
            "tests/unit/test_buffer.py::test_staleness_admission_at_put_requeue",
        ),
    ),
    Mutation(
        "fencing off (settle accepts any token of a known task)",
        "moerl/runtime/queue.py",
        "            self._reap_locked()\n            entry = self._current_entry_locked(task_id, token)\n"
        '            if entry is None:\n                self._counts["refused"] += 1',
        "            self._reap_locked()\n            entry = self._entries.get(task_id)\n"
        '            if entry is None:\n                self._counts["refused"] += 1',
        (
            "tests/unit/test_buffer.py::test_late_delivery_refused_by_fencing_token",
            "tests/unit/test_queue.py::test_ack_after_expiry_refused_and_task_released_with_higher_token",
        ),
    ),
    Mutation(
        "sharded loss normalizers swapped for the one-rank ones (per-rank token and sequence counts)",
        "moerl/trainer/distributed/sharded.py",
        "        dist.all_reduce(counts)\n        return replace(batch, num_tokens=int(counts[0]), num_seqs=int(counts[1]))",
        "        return batch",
        (
            "tests/distributed/test_sharded_trainer.py::test_sharded_steps_and_weights_equal_one_rank[R2-EP2-alltoall-G8]",
        ),
    ),
)


def _is_git_checkout() -> bool:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--is-inside-work-tree"], capture_output=True
        )
    except FileNotFoundError:
        return False
    return out.returncode == 0


pytestmark = [
    pytest.mark.skipif(not _is_git_checkout(), reason="needs git and a git checkout (git ls-files)"),
    pytest.mark.timeout(3 * TIMEOUT_S + 60),  # the first test also waits for the module fixture's six jobs
]


def _copy_repo(dest: Path) -> Path:
    """The tracked files of this checkout (as they are in the work tree) copied under ``dest``, its
    ``moerl`` package compiled to bytecode (once here rather than once in every job)."""
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True
    ).stdout.split(b"\0")
    for rel in (f.decode() for f in files if f):
        src = ROOT / rel
        if src.is_file():  # a file deleted in the work tree but still tracked is skipped
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    compileall.compile_dir(dest / "moerl", quiet=1)
    return dest


def _clone(base: Path, dest: Path) -> Path:
    """``base`` hard-linked under ``dest``: every file is shared, so nothing may write one in place
    (Python and pytest write bytecode by rename, which replaces the link; ``_mutate`` writes a new file;
    the catching tests write under their ``tmp_path``)."""
    shutil.copytree(base, dest, copy_function=os.link, dirs_exist_ok=True)
    return dest


def _mutate(copy: Path, mutation: Mutation) -> int:
    """Apply ``mutation`` in ``copy`` as a new file (the hard-linked original is left as it is) and drop
    that file's bytecode; returns how many times its old text occurs (applied only when exactly once)."""
    path = copy / mutation.file
    text = path.read_text()
    found = text.count(mutation.old)
    if found == 1:
        path.unlink()
        path.write_text(text.replace(mutation.old, mutation.new))
        for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
            pyc.unlink()
    return found


UNUSED_PLUGINS = ("cacheprovider", "hypothesispytest", "benchmark", "anyio", "xdist", "xdist.looponfail")
"""pytest plugins a job's catching tests do not use, left unloaded: each job is one pytest process, and
importing pytest-benchmark, anyio (with trio) and xdist cost a ``pytest --co`` of one unit-test file 0.6-1.4 s
of its 6.5-9 s of CPU on the loaded 2-core machine (2026-12-07), in each of the module's six jobs.
pytest-timeout stays: the catching tests' limits hold there too."""


PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "numpy",
    "safetensors.torch",
    "yaml",
    "pytest",
)
"""What the job server imports once before it forks each job (``_ZYGOTE``): torch and what the catching tests
import besides moerl. Each job used to be a fresh interpreter importing them: 7-8 s of CPU a job for ``pytest
--co`` of one unit-test file on the loaded 2-core machine (2026-12-07), torch 4 of them, in each of the six
jobs. Nothing here may import moerl (the server checks): each job imports its own copy's."""

_ZYGOTE = r"""
import importlib, json, os, signal, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
assert not [m for m in sys.modules if m.split(".")[0] == "moerl"], "the job server imported moerl"
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the jobs; each writes its own exit code
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid:
        print(pid, flush=True)
        continue
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the job's own subprocesses are waited for
    os.setsid()  # its own process group: a job that outlives the timeout is killed with its children
    null, out = os.open(os.devnull, os.O_RDONLY), os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(null, 0), os.dup2(out, 1), os.dup2(out, 2)
    code = 1
    try:
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        sys.path.insert(0, job["cwd"])
        import moerl
        if not moerl.__file__.startswith(job["cwd"]):
            print("the job imports another moerl: " + moerl.__file__)
        else:
            import pytest
            code = int(pytest.main(job["args"]))
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        with open(job["out"] + ".rc.tmp", "w") as f:
            f.write(str(code))
        os.replace(job["out"] + ".rc.tmp", job["out"] + ".rc")
        os._exit(code)
os._exit(0)  # stdin closed: no jobs left (skips tearing down torch's modules)
"""
"""The job server: imports ``PRELOAD`` (argv), then forks one job per JSON line on stdin (``cwd``: the clone,
``env``, ``args`` of ``pytest.main``, ``out``: where its stdout and stderr go) and answers its pid; the job
puts its clone first on ``sys.path`` before anything imports moerl, and writes its exit code to ``out.rc``.
It is single-threaded (no thread pool has started before the fork: only imports ran)."""


class _JobServer:
    """One ``_ZYGOTE`` process serving the module fixture's jobs (two at a time, from two threads)."""

    def __init__(self, folder: Path):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
        env["OMP_NUM_THREADS"] = "1"  # one thread each: two jobs run at once (``outcomes``)
        self.folder, self.env = folder, env
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE, *PRELOAD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=folder,
        )
        self.lock = threading.Lock()

    def pytest(self, copy: Path, args: tuple[str, ...], name: str) -> subprocess.CompletedProcess:
        """``pytest -x -q args`` in ``copy`` importing the copy's moerl (``PYTHONPATH``), as a subprocess
        would; raises ``subprocess.TimeoutExpired`` after ``TIMEOUT_S`` (the job killed)."""
        argv = ["-x", "-q", *(f"-pno:{p}" for p in UNUSED_PLUGINS), *args]
        out = self.folder / f"{name}.out"
        job = {"cwd": str(copy), "env": {**self.env, "PYTHONPATH": str(copy)}, "args": argv, "out": str(out)}
        with self.lock:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:  # its preload failed (its traceback is on this process' stderr)
            raise RuntimeError(
                f"the mutation check's job server exited ({self.proc.poll()}) before job {name}"
            )
        pid = int(line)
        rc = Path(f"{out}.rc")
        deadline = time.monotonic() + TIMEOUT_S
        while not rc.exists():
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)  # the job's own process group (``os.setsid``)
                raise subprocess.TimeoutExpired(argv, TIMEOUT_S, out.read_text())
            if is_gone(pid):  # died without writing its code (a crash), or a zombie just done
                if rc.exists():
                    break
                return subprocess.CompletedProcess(argv, -1, out.read_text(), "")
            time.sleep(0.5)
        return subprocess.CompletedProcess(argv, int(rc.read_text()), out.read_text(), "")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _tail(proc: subprocess.CompletedProcess, lines: int = 15) -> str:
    return "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-lines:])


UNMUTATED = "unmutated"


def _run(server: _JobServer, key: str, copy: Path) -> tuple[str, object]:
    """One job in its clone ``copy``: the unmutated catching tests, or one mutation's tests.
    Returns ``("ran", CompletedProcess)``, or ``("drift", count)`` when a mutation's old text is not there
    exactly once."""
    if key == UNMUTATED:
        return "ran", server.pytest(copy, tuple(dict.fromkeys(t for m in MUTATIONS for t in m.tests)), key)
    mutation = next(m for m in MUTATIONS if Path(m.file).stem == key)
    found = _mutate(copy, mutation)
    if found != 1:
        return "drift", found
    return "ran", server.pytest(copy, mutation.tests, key)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[str, object]]:
    """Every job's outcome, two subprocesses at a time (each is one single-threaded pytest; a 2-core
    machine runs two at once in about half the time), each in its clone of one copy."""
    # the jobs beyond unit tests (multi-process worlds, runs) first: the two longest run side by side
    # rather than one alone at the end
    heavy_first = sorted(MUTATIONS, key=lambda m: all(t.startswith("tests/unit/") for t in m.tests))
    keys = [UNMUTATED, *(Path(m.file).stem for m in heavy_first)]
    base = _copy_repo(tmp_path_factory.mktemp("copy"))
    copies = [_clone(base, tmp_path_factory.mktemp(k)) for k in keys]  # all before any job writes
    server = _JobServer(tmp_path_factory.mktemp("jobs"))
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            return dict(zip(keys, pool.map(partial(_run, server), keys, copies), strict=True))
    finally:
        server.close()


def test_the_catching_tests_pass_unmutated(outcomes):
    _, proc = outcomes[UNMUTATED]  # an unknown node id exits 4
    assert proc.returncode == 0, f"the catching tests fail without any mutation:\n{_tail(proc)}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, _tail(proc)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: Path(m.file).stem)
def test_mutation_is_caught(outcomes, mutation):
    kind, result = outcomes[Path(mutation.file).stem]
    assert kind == "ran", (
        f"mutation {mutation.name!r}: its old text occurs {result} times in {mutation.file} "
        "(the code moved): update MUTATIONS in tests/meta/test_mutations.py"
    )
    assert result.returncode == 1 and " failed" in result.stdout, (
        f"mutation {mutation.name!r} not caught by {' '.join(mutation.tests)} (exit {result.returncode}):\n"
        + _tail(result)
    )


def test_a_mutation_changes_only_its_clone(tmp_path):
    """The clones share their files with the copy by hard links: a mutation must reach its own clone (its
    stale bytecode gone) and neither the copy nor another clone (the unmutated job runs beside it)."""
    base = tmp_path / "copy"
    (base / "pkg" / "__pycache__").mkdir(parents=True)
    (base / "pkg" / "mod.py").write_text("x = 1\n")
    (base / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"bytecode of x = 1")
    mine, other = _clone(base, tmp_path / "mine"), _clone(base, tmp_path / "other")
    assert _mutate(mine, Mutation("x changed", "pkg/mod.py", "x = 1", "x = 2", ("t",))) == 1
    assert (mine / "pkg" / "mod.py").read_text() == "x = 2\n"
    assert not list((mine / "pkg" / "__pycache__").glob("mod.*.pyc"))
    for untouched in (base, other):
        assert (untouched / "pkg" / "mod.py").read_text() == "x = 1\n"
        assert (
            untouched / "pkg" / "__pycache__" / "mod.cpython-311.pyc"
        ).read_bytes() == b"bytecode of x = 1"
    assert _mutate(other, Mutation("drifted", "pkg/mod.py", "y = 1", "y = 2", ("t",))) == 0
    assert (other / "pkg" / "mod.py").read_text() == "x = 1\n"
