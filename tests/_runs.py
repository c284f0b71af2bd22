"""Helpers of the tests that start real runs (tests/e2e, tests/distributed): fresh policies, run folders,
exactly-once books.

Imported as ``_runs``: pytest puts ``tests/`` on ``sys.path`` when it loads ``tests/conftest.py``
(the default ``prepend`` import mode), as it does each test file's own folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moerl.config import ModelConfig, RunConfig, load_config
from moerl.models import build_model, save_pretrained
from moerl.rundir.folder import RunDir, read_jsonl
from moerl.tasks import load_tokenizer

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
"""The project's default run config (``configs/default.yaml``)."""

SHARDED_ASYNC = (
    "trainer.batch_groups=4",
    "trainer.micro_batch_size=32",
    "trainer.lr=3e-3",
    "trainer.warmup_steps=0",
    "trainer.num_ranks=2",
    "trainer.ep_size=2",
    "rollout.num_workers=1",
    "rollout.max_new_tokens=4",
    "rollout.max_slots=32",
    "rollout.kv_token_budget=1024",
    "runtime.buffer_groups=8",
    "task.reward_fn=dist_rewards:first_is_digit",
    "eval.every=0",
)
"""Overrides that shorten ``DEFAULT_CONFIG`` to an async run of a 2-rank sharded trainer (EP 2) next to one
rollout worker: 4 groups a step, 4 new tokens, ``dist_rewards:first_is_digit`` (learnable at lr 3e-3).
The steps, checkpoints and held-out set are each test's own."""


def run_config(path: Path | None, output_dir: Path, init: Path, *overrides: str) -> RunConfig:
    """``load_config(path, overrides)`` of a run into ``output_dir`` that starts from the policy folder
    ``init``; ``overrides`` as on the command line (``"trainer.steps=4"``, ...)."""
    return load_config(path, [f"output_dir={output_dir}", f"init_from={init}", *overrides])


def save_fresh_policy(path: Path, model: ModelConfig | None = None) -> Path:
    """Save a fresh model of ``model`` (None: the default config's) with the built-in tokenizer at ``path``.

    The weights are drawn after ``torch.manual_seed(0)``, so every call with the same config saves the
    same policy. ``path`` becomes a Hugging Face folder (config, safetensors, tokenizer); returns it.
    """
    tok = load_tokenizer(None)
    torch.manual_seed(0)
    cfg = load_config(DEFAULT_CONFIG).model if model is None else model
    save_pretrained(build_model(cfg, tok.vocab_size), path)
    tok.save(path)
    return path


DAMAGED_FOLDER_MESSAGES = [
    ("garbled config", "config.json: not valid JSON (Expecting ',' delimiter: line 1 column 28"),
    ("truncated weights", "model.safetensors: not a readable safetensors file (Error while deserializing header"),
    ("no model_type", "config.json: unknown architecture (model_type=None, no 'architectures'); supported: "),
]  # fmt: skip
"""(kind of ``damage_model_folder``, what the one-line error then says of the folder's file)."""


def damage_model_folder(folder: Path, kind: str) -> None:
    """Damage a saved policy folder as a fresh user found them: ``kind`` is ``"garbled config"`` (a
    config.json that is not JSON), ``"truncated weights"`` (model.safetensors cut after 2000 bytes) or
    ``"no model_type"`` (a config.json naming no architecture)."""
    if kind == "garbled config":
        (folder / "config.json").write_text('{"model_type": "qwen3_moe" "vocab_size": 3}')
    elif kind == "truncated weights":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:2000])
    elif kind == "no model_type":
        cfg = json.loads((folder / "config.json").read_text())
        cfg.pop("model_type"), cfg.pop("architectures", None)
        (folder / "config.json").write_text(json.dumps(cfg))
    else:
        raise ValueError(f"unknown damage {kind!r}")


def newest_run(cfg: RunConfig) -> RunDir:
    """The newest run folder ``<output_dir>/<name>-*`` of ``cfg`` (by modification time).

    Raises:
        ValueError: there is none (the run did not start).
    """
    return RunDir(max(Path(cfg.output_dir).glob(f"{cfg.name}-*"), key=lambda p: p.stat().st_mtime))


def assert_trained_exactly_once(summary: dict, run: RunDir, steps: int, batch_groups: int) -> None:
    """Assert the books of a completed run of ``steps`` steps of ``batch_groups`` groups each: every task
    id in the ledger trained once, ``steps * batch_groups`` of them, none lost or duplicated, and one
    metrics record a step (steps 1..``steps`` in order)."""
    counts = Counter(e.task_id for e in run.read_ledger())
    assert len(counts) == steps * batch_groups and set(counts.values()) == {1}  # each trained id once
    assert summary["tasks_trained"] == steps * batch_groups
    assert summary["tasks_duplicated"] == 0 and summary["tasks_lost"] == 0
    assert [r["step"] for r in read_jsonl(run.metrics)] == list(range(1, steps + 1))


def free_port() -> int:
    """A free TCP port on 127.0.0.1 in 20000-29999: below the kernel's ephemeral range (32768-60999) and
    above Ray's worker ports (10002-19999). A port the kernel hands out for port 0 is ephemeral: between
    the check and a server's bind another process's connection took one (a run then stopped with
    "already in use")."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29999")


@contextlib.contextmanager
def report_figures_skipped() -> Iterator[list[Path]]:
    """Runs started in this process meanwhile (``moerl.train.train``/``resume``, in process) skip drawing
    ``report.png`` and ``report_fleet.png``: ``moerl.train.plot_report`` appends the run folder it was
    asked to draw to the yielded list instead.

    For test modules whose runs nobody reads the figures of: a run's two figures are 0.5-1 s of CPU
    (matplotlib's constrained layout and PNG encoding; 4-7 s on the loaded 2 cores, up to half of a short
    sharded run). The figures are tested in tests/unit/test_report_figure.py, test_fleet_report.py and
    test_telemetry.py, and a run's own call of ``plot_report`` in tests/e2e/test_hf_gsm8k.py.
    """
    asked: list[Path] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("moerl.train.plot_report", asked.append)
        yield asked


_SHARED_RAY: dict[str, str | None] = {}
"""While ``start_shared_ray``'s instance is up: ``{"pythonpath": PYTHONPATH before it started}``."""


def start_shared_ray(module, pythonpath: Path) -> None:
    """Start one local Ray instance (6 CPUs, no dashboard) for consecutive test modules, unless this
    process' shared one is up already; ``module``'s own classes travel by value (e.g. a stand-in worker).

    Ray's worker processes take PYTHONPATH from the driver's environment at Ray's start, so ``pythonpath``
    (the folder of the tests' reward and environment modules) is prepended to it until ``stop_shared_ray``.
    A Ray start and stop is about 10 CPU-s of Ray's own processes on the 2-core test machine: modules of one
    xdist group (``pytest.mark.ray_group``, tests/conftest.py) that share an instance save one a module.
    """
    import ray

    from moerl.runtime.ray import start_local_ray

    if not (_SHARED_RAY and ray.is_initialized()):
        stop_shared_ray()
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), old) if p)
        _SHARED_RAY["pythonpath"] = old
        start_local_ray(num_cpus=6, include_dashboard=False, configure_logging=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(module)


def stop_shared_ray() -> None:
    """Shut ``start_shared_ray``'s instance down and restore PYTHONPATH; nothing when none is up.
    tests/conftest.py calls it before every test that does not use the ``shared_ray`` fixture and at the
    session's end, so no other test finds it running."""
    if not _SHARED_RAY:
        return
    import ray

    ray.shutdown()
    old = _SHARED_RAY.pop("pythonpath")
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old
