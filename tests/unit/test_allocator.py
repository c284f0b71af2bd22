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


def test_freeze_long_lived_leaves_objects_out_until_the_block_ends():
    import gc

    from moerl.allocator import freeze_long_lived, unfreezes_on_exit

    kept = [object()]  # a tracked container created before the freeze
    with unfreezes_on_exit():
        assert freeze_long_lived() > 0
        assert not any(o is kept for o in gc.get_objects())  # frozen: no collection walks it
    assert gc.get_freeze_count() == 0
    assert any(o is kept for o in gc.get_objects())  # back with the collector


def test_a_runs_steps_run_with_its_start_up_objects_frozen(tmp_path, monkeypatch):
    import gc

    from _runs import run_config, save_fresh_policy

    from moerl import train as train_module

    seen = []  # per step: frozen objects, whether the trainer (built after the warm start) is among them
    step = train_module.Run.step

    def observed_step(self):
        seen.append((gc.get_freeze_count(), not any(o is self.trainer for o in gc.get_objects())))
        step(self)

    monkeypatch.setattr(train_module.Run, "step", observed_step)
    init = save_fresh_policy(tmp_path / "policy")
    cfg = run_config(
        None,
        tmp_path / "runs",
        init,
        "runtime.mode=sync",
        "trainer.steps=2",
        "trainer.batch_groups=2",
        "trainer.micro_batch_size=16",
        "rollout.group_size=2",
        "rollout.max_slots=8",
        "rollout.kv_token_budget=256",
        "rollout.max_new_tokens=4",
        "eval.every=0",
        "task.num_eval=4",
    )
    train_module.train(cfg, live=False)
    assert len(seen) == 2 and min(n for n, _ in seen) > 10_000  # the imports, policy, engine: frozen
    assert all(trainer_frozen for _, trainer_frozen in seen)  # frozen after the start, not only the imports
    assert gc.get_freeze_count() == 0  # handed back when the run ended
