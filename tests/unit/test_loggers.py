"""TensorBoard and W&B loggers: files written by ``Loggers`` are read back with each tool's own library."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from moerl.config import ConfigError, TelemetryConfig, load_config
from moerl.telemetry.loggers import FAMILIES, Loggers, logger_name, scalars
from moerl.telemetry.metrics import METRIC_KEYS, make_record


def _record(step: int) -> dict:
    values = {
        "rollout/reward_mean": 0.25 * step,
        "buffer/depth": step,
        "train/pg_loss": -0.5,
        "policy_version": step,
    }
    rec = make_record(step, 1.5 * step, values)
    rec["rollout/workers"] = {"rollout-0": {"tokens_per_s": 100.0 * step, "is_up": 1}}
    return rec


def test_every_metric_key_maps_into_a_family():
    names = [logger_name(k) for k in METRIC_KEYS]
    assert all(n.startswith(FAMILIES) for n in names)
    assert len(set(names)) == len(names)  # no two keys collide
    assert logger_name("buffer/depth") == "rollout/buffer_depth"
    assert logger_name("fleet/killed") == "rollout/fleet_killed"
    assert logger_name("policy_version") == "train/policy_version"
    assert logger_name("timing/gen_s") == "timing/gen_s"
    with pytest.raises(KeyError):
        logger_name("nonsense")


def test_scalars_drop_none_and_flatten_workers():
    out = scalars(_record(2))
    assert "eval/accuracy" not in out and "step" not in out and "wall_s" not in out
    assert out["rollout/buffer_depth"] == 2.0
    assert out["rollout/worker_rollout-0_tokens_per_s"] == 200.0


def test_config_requires_jsonl_and_known_loggers():
    assert load_config(None, ["telemetry.loggers=[jsonl, tensorboard]"]).telemetry.loggers == (
        "jsonl",
        "tensorboard",
    )
    with pytest.raises(ConfigError, match="must include jsonl"):
        TelemetryConfig(loggers=("tensorboard",))
    with pytest.raises(ConfigError, match="telemetry.loggers"):
        TelemetryConfig(loggers=("jsonl", "mlflow"))
    with pytest.raises(ConfigError, match="metrics_port"):
        TelemetryConfig(metrics_port=70000)


def test_tensorboard_event_files_read_back(tmp_path):
    import tensorboard  # noqa: F401 - the test extra installs it: missing fails, not skips
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loggers = Loggers(TelemetryConfig(loggers=("jsonl", "tensorboard")), tmp_path)
    for step in (1, 2, 3):
        loggers.log(_record(step))
    loggers.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"rollout/reward_mean", "rollout/buffer_depth", "train/pg_loss", "train/policy_version"} <= tags
    assert [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [e.value for e in acc.Scalars("rollout/worker_rollout-0_tokens_per_s")] == [100.0, 200.0, 300.0]


def _wandb_records(path: Path):
    """Records of a ``.wandb`` transaction log (LevelDB log framing: 32 KiB blocks of chunks with a
    7-byte header crc32c/length/type after the file's 7-byte ':W&B' header), parsed with wandb's own
    protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too short for a header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 or len(chunk) < length:  # end of the data written so far
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


def test_wandb_offline_run_reads_back(tmp_path, monkeypatch):
    import wandb  # noqa: F401 - the test extra installs it: missing fails, not skips

    monkeypatch.setenv("WANDB_API_KEY", "")  # never log in from a test
    cfg = TelemetryConfig(loggers=("jsonl", "wandb"), wandb_project="moerl-test")
    loggers = Loggers(cfg, tmp_path / "run-x", {"trainer": {"lr": 0.001}})
    run_dir = loggers.loggers[0].run_dir
    for step in (1, 2, 3):
        loggers.log(_record(step))
    loggers.close()
    assert run_dir.name.startswith("offline-run-")
    (log,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + 30  # wandb-core (its own process) may still be writing after finish()
    while True:
        records = _wandb_records(log)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, "the W&B run was never finished"
        time.sleep(0.2)
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["rollout/reward_mean"] for h in history] == [0.25, 0.5, 0.75]
    assert history[2]["rollout/buffer_depth"] == 3
    assert history[0]["rollout/worker_rollout-0_tokens_per_s"] == 100
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "moerl-test" and run.display_name == "run-x"
