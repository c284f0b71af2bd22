"""Every config in examples/ runs, shortened, as examples/README.md runs it (issue 51): the Hugging Face
model + Parquet + reward + chat template example through the Python API (``moerl.api.train``) in a fresh
interpreter from the example's own folder, the one-GPU example on CPU, and the cluster example through
``moerl cluster render``."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moerl.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SHORT = dict(  # a few seconds of each phase: warm start, start eval, RL steps
    sft__steps=3, trainer__steps=2, trainer__batch_groups=2, task__num_eval=8, eval__every=2,
    rollout__group_size=4, rollout__max_slots=8, rollout__kv_token_budget=2048,
)  # fmt: skip
"""``section__field`` overrides that shorten an example to a CPU test."""


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory) -> Path:
    """A copy of examples/ (configs, reward, script) with the stand-ins ``make_tiny_model.py`` writes:
    ``my_model/`` and a 200-row ``data/train.parquet``."""
    folder = tmp_path_factory.mktemp("examples")
    for name in ("hf_parquet.yaml", "one_gpu.yaml", "my_reward.py", "make_tiny_model.py"):
        shutil.copy(EXAMPLES / name, folder / name)
    spec = importlib.util.spec_from_file_location("make_tiny_model", folder / "make_tiny_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.save_model(folder / "my_model")
    script.save_rows(folder / "data" / "train.parquet", 200)
    return folder


def test_the_hf_parquet_example_runs_from_python_and_returns_the_summary(example_dir):
    code = (
        "import json; from moerl.api import train; "
        f"s = train('hf_parquet.yaml', **{SHORT!r}); print('SUMMARY', json.dumps(s))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree's moerl; my_reward only beside the config
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=example_dir, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("SUMMARY ")]
    summary = json.loads(line[len("SUMMARY ") :])
    run = (example_dir / summary["policy"]).parent
    assert summary == json.loads((run / "summary.json").read_text())  # the run's summary, as written
    assert summary["status"] == "completed" and summary["steps"] == 2  # trainer__steps=2 applied
    assert summary["tasks_duplicated"] == summary["tasks_lost"] == 0 and summary["reward_errors"] == 0
    assert summary["final_eval_accuracy"] is not None  # scored through my_reward's "correct"
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["sft"]["steps"] == 3 and config["task"]["prompt_format"] == "chat"
    assert "warm start: SFT for 3 steps" in out.stderr  # the config's warm start, shortened
    prompts = (run / "metrics.jsonl").read_text()
    assert prompts.count('"step"') == 2


def test_the_one_gpu_example_runs_on_cpu(example_dir, monkeypatch, capsys):
    monkeypatch.chdir(example_dir)  # its paths are relative to its folder, as examples/README.md runs it
    sets = [f"{k.replace('__', '.')}={v}" for k, v in SHORT.items()]
    sets += ["model.device=cpu", "model.dtype=float32", "rollout.max_new_tokens=8", "output_dir=runs_gpu"]
    args = ["train", "--config", "one_gpu.yaml"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0, capsys.readouterr().err[-3000:]
    (run,) = (example_dir / "runs_gpu").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    config = yaml.safe_load((run / "config.yaml").read_text())
    # paths resolve beside the config file: the run's config records where the model was found
    assert config["model"]["path"] == str(example_dir / "my_model")


def test_the_cluster_example_renders(tmp_path):
    out = tmp_path / "out"
    args = ["cluster", "render", "--config", str(EXAMPLES / "cluster.yaml"), "--out", str(out)]
    args += ["--set", "cluster.image=registry.example/moerl:0.1.0"]
    assert main(args) == 0
    docs = {p.name: list(yaml.safe_load_all(p.read_text())) for p in out.rglob("*.yaml")}
    run = yaml.safe_load(docs["20-run-config.yaml"][0]["data"]["run.yaml"])
    trainer, rollout = run["trainer"], run["rollout"]
    assert (trainer["num_ranks"], trainer["ep_size"], rollout["num_workers"]) == (4, 4, 2)
    assert run["init_from"].endswith("/OLMoE-1B-7B-0924")  # cluster.model_url, copied by the init container
    groups = {g["name"]: g for g in docs["eksctl-cluster.yaml"][0]["managedNodeGroups"]}
    assert groups["train"]["instanceTypes"] == ["g6e.12xlarge"] and groups["rollout"]["spot"] is True
