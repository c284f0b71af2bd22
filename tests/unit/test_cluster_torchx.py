"""docs/cluster.md's TorchX line renders (``torchx run --dryrun``) into the Volcano job the run needs."""

import base64
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torchx  # noqa: F401 - the test extra installs it: missing fails, not skips
import yaml

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/moerl:0.1.0"
"""The README's ``$IMAGE``: the image the user built and pushed."""


def _readme_line() -> list[str]:
    lines = [ln.strip() for ln in (ROOT / "docs" / "cluster.md").read_text().splitlines()]
    (line,) = [ln for ln in lines if ln.startswith("torchx run -s kubernetes")]
    return [a.replace("$IMAGE", IMAGE) for a in shlex.split(line)]  # as the README's shell expands it


def _dryrun(argv: list[str]) -> dict:
    """Run ``torchx run --dryrun ...`` from the repository root; the Volcano Job it would submit."""
    assert argv[:2] == ["torchx", "run"]
    cmd = [sys.executable, "-m", "torchx.cli.main", "run", "--dryrun", *argv[2:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, request = proc.stdout.split("=== SCHEDULER REQUEST ===")
    return yaml.safe_load(request)


def _tasks(job: dict) -> dict[str, dict]:
    return {t["name"]: t["template"]["spec"] for t in job["spec"]["tasks"]}


def test_readme_line_renders_the_mission_job():
    argv = _readme_line()
    assert "--num_rollout_workers" in argv and "--checkpoint_dir" in argv
    job = _dryrun(argv)
    assert job["kind"] == "Job" and job["apiVersion"] == "batch.volcano.sh/v1alpha1"
    assert job["spec"]["queue"] == "default" and job["spec"]["schedulerName"] == "volcano"
    tasks = _tasks(job)
    names = sorted(re.sub(r"-\d+$", "", n) for n in tasks)
    assert names.count("train") == 16 and names.count("rollout") == 32 and names.count("memory") == 1
    head = tasks["train-0"]["containers"][0]
    script = head["command"][-1]
    assert "ray start --head" in script and "moerl train --config /tmp/run.yaml" in script
    for name, spec in tasks.items():
        container = spec["containers"][0]
        if name != "train-0":
            assert "--address=$(printenv VC_TRAIN_0_HOSTS):6379" in container["command"][-1], name
        limits = container["resources"]["limits"]
        if name.startswith("train"):
            assert limits["nvidia.com/gpu"] == "8" and limits["vpc.amazonaws.com/efa"] == "32"
            assert '{"train": 8.0}' in container["command"][-1]
        if name.startswith("rollout"):
            assert limits["nvidia.com/gpu"] == "8" and '{"rollout": 1.0}' in container["command"][-1]
    env = {e["name"]: e["value"] for e in head["env"]}
    run = yaml.safe_load(base64.b64decode(env["MOERL_RUN_CONFIG"]))
    assert run["rollout"]["num_workers"] == 32 and run["fleet"]["max_workers"] == 32
    assert run["storage"]["url"] == argv[argv.index("--checkpoint_dir") + 1]
    assert run["runtime"]["ray_address"] == "auto" and run["cluster"]["train"]["max_nodes"] == 16
    assert run["fleet"]["imds_url"] == "http://169.254.169.254" and run["model"]["device"] == "cuda"


def test_fewer_rollout_workers_fewer_pods():
    argv = _readme_line()
    argv[argv.index("--num_rollout_workers") + 1] = "8"
    tasks = _tasks(_dryrun(argv))
    assert sum(n.startswith("rollout-") for n in tasks) == 8


def test_a_bad_config_is_refused_before_submission():
    argv = [*_readme_line(), "--config", "configs/no_such_file.yaml"]
    cmd = [sys.executable, "-m", "torchx.cli.main", "run", "--dryrun", *argv[2:]]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "no_such_file.yaml" in proc.stderr
