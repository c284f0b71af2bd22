"""tests/setup.sh stops with one line when it cannot install what the tests need (promtool, prometheus):
not root, no apt-get, apt-get failing, or the package not providing them. Each case runs the script with a
PATH of stand-in commands and no promtool, so it stops before installing anything."""

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "setup.sh"

CASES = {  # name -> (stand-in commands: name -> shell body, the line's start)
    "not root": ({"id": "echo 1000"}, "tests/setup.sh: promtool/prometheus missing and not root"),
    "no apt-get": ({"id": "echo 0"}, "tests/setup.sh: promtool/prometheus missing and no apt-get"),
    "apt-get fails": (
        {"id": "echo 0", "apt-get": "echo 'E: Unable to locate package prometheus' >&2; exit 100"},
        "tests/setup.sh: apt-get install prometheus failed",
    ),
    "nothing installed": (
        {"id": "echo 0", "apt-get": "exit 0"},
        "tests/setup.sh: promtool still missing after apt-get install prometheus",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_setup_stops_with_one_line_when_it_cannot_install_prometheus(tmp_path, case):
    commands, line = CASES[case]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("dirname",):
        (bin_dir / name).symlink_to(shutil.which(name))
    for name, body in commands.items():
        (bin_dir / name).write_text(f"#!{shutil.which('bash')}\n{body}\n")
        (bin_dir / name).chmod(0o755)
    proc = subprocess.run(
        [shutil.which("bash"), str(SCRIPT)],
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    ours = [x for x in proc.stderr.splitlines() if x.startswith("tests/setup.sh:")]
    assert len(ours) == 1 and ours[0].startswith(line), proc.stderr
