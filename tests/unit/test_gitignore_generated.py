"""Generated output of the README's commands is ignored by git (``git status`` stays clean after them)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _is_work_tree() -> bool:
    if shutil.which("git") is None:
        return False
    done = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT, capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not _is_work_tree(), reason="needs git and a git checkout")
def test_cluster_render_outputs_of_the_readme_are_ignored():
    outs = re.findall(r"moerl cluster render [^\n]*--out (deploy/\S+)", (ROOT / "README.md").read_text())
    assert outs, "the README's cluster render commands write under deploy/"
    for out in outs:
        path = f"{out}/eksctl-cluster.yaml"
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert done.returncode == 0, f"{path} is not ignored by .gitignore"
        tracked = subprocess.run(["git", "ls-files", out], cwd=ROOT, capture_output=True, text=True)
        assert tracked.stdout == "", f"{out} holds tracked files: it is not only generated output"
