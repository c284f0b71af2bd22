"""keep_freed_memory: glibc keeps freed blocks, so repeated allocations stop page-faulting."""

import subprocess
import sys

import pytest

from moerl.allocator import MMAP_THRESHOLD_MAX, keep_freed_memory

# Each round allocates three zero-filled 4 MiB blocks (every page touched) and frees them. By default glibc
# serves them from its heap after the first round, but the 12 MiB freed at the top of the heap exceed its
# dynamic trim threshold (2 x 4 MiB), so it hands them back and the next round faults them in again.
ROUNDS = """
import resource, sys
if sys.argv[1] == "keep":
    from moerl.allocator import keep_freed_memory
    assert keep_freed_memory()
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [bytearray(4 << 20) for _ in range(3)]
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


def _faults_per_round(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True)
    return [int(x) for x in out.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_freed_blocks_are_reused_without_page_faults():
    plain, kept = _faults_per_round("plain"), _faults_per_round("keep")
    pages = 3 * (4 << 20) // 4096
    assert min(plain[2:]) > pages // 2  # the default gives the memory back every round
    assert max(kept[1:]) < 100  # kept: after the first round the pages are already there


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="mmap_threshold"):
        keep_freed_memory(mmap_threshold=MMAP_THRESHOLD_MAX + 1)
    with pytest.raises(ValueError, match=">= 0"):
        keep_freed_memory(trim_threshold=-1)
