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
    guides = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]
    text = "\n".join(p.read_text() for p in guides if p.exists())
    outs = re.findall(r"moerl cluster render [^\n]*--out (deploy/\S+)", text)
    assert len(outs) >= 2, "the guides' cluster render commands (README, docs/cluster.md) write under deploy/"
    for out in outs:
        path = f"{out}/eksctl-cluster.yaml"
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert done.returncode == 0, f"{path} is not ignored by .gitignore"
        tracked = subprocess.run(["git", "ls-files", out], cwd=ROOT, capture_output=True, text=True)
        assert tracked.stdout == "", f"{out} holds tracked files: it is not only generated output"
