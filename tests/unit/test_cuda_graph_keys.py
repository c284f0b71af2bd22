"""CUDA-graph keys that recur in a run: batch buckets, read-length rounding, and the LRU of graphs.

A run's decode batch size and read length change every few steps; without rounding, every step meets a
new key and the engine captures until its cap, then decodes eagerly (what the first GPU runs showed).
"""

import pytest
import torch

from moerl.rollout.cuda_graphs import GraphRunner, graph_batch_buckets, round_read_len


def test_batch_buckets_pad_at_most_half_and_end_at_the_cap():
    for n in (1, 2, 7, 100, 256, 1000):
        buckets = graph_batch_buckets(n)
        assert buckets[0] == 1 and buckets[-1] == n and list(buckets) == sorted(set(buckets))
        for a in range(1, n + 1):
            b = min(x for x in buckets if x >= a)
            assert b <= max(1.5 * a, 1), (n, a, b)
    assert len(graph_batch_buckets(256)) == 16
    with pytest.raises(ValueError, match="max_rows=0"):
        graph_batch_buckets(0)


def test_read_len_keys_are_few_and_at_most_a_quarter_over():
    keys = {round_read_len(n, 64, 16384) for n in range(1, 16385)}
    assert len(keys) <= 4 + 4 * 8  # multiples of 64 up to 256, then four per doubling
    for n in range(1, 16385, 7):
        r = round_read_len(n, 64, 16384)
        assert r >= n and r % 64 == 0 and (n <= 256 or r <= 1.25 * n), (n, r)
    assert round_read_len(5000, 64, 4096) == 4096  # the cap wins
    with pytest.raises(ValueError, match="multiple=0"):
        round_read_len(10, 0, 64)


class _FakeGraph:
    def __init__(self, key, replays):
        self.key, self.replays = key, replays

    def replay(self):
        self.replays.append(self.key)


def test_runner_evicts_the_least_recently_replayed_graph_and_keeps_replaying():
    runner = GraphRunner("cpu", max_graphs=2)
    runner.is_enabled = True  # the keyed bookkeeping, with a stand-in for the CUDA capture
    replays: list = []

    def capture(key, fn):
        return _FakeGraph(key, replays), (fn()[0],)

    runner._capture = capture
    step = lambda: (torch.tensor([1.0]),)  # noqa: E731
    for key in ("a", "b", "a", "c", "a", "b"):
        runner.run(key, step)
    # "b" was the least recently replayed when "c" came, then "c" when "b" came back
    assert runner.keys == ["a", "b"] and runner.num_evictions == 2 and runner.num_captures == 4
    assert replays == ["a", "b", "a", "c", "a", "b"] and runner.num_replays == 6 and runner.is_enabled
    with pytest.raises(ValueError, match="max_graphs=0"):
        GraphRunner("cpu", max_graphs=0)


def test_a_failed_capture_names_the_first_error_not_the_capture_end():
    from moerl.rollout.cuda_graphs import _first_error

    try:
        try:
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
        finally:
            raise RuntimeError("operation failed due to a previous error during capture")  # noqa: B012
    except RuntimeError as e:
        assert "Cannot copy" in str(_first_error(e))
