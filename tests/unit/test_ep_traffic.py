"""moerl.ep.traffic: per-direction readings, their differences and sums over ranks (hand-computed)."""

from __future__ import annotations

import pytest
import torch

from moerl.ep.layout import Traffic
from moerl.ep.traffic import dispatcher_traffic, model_dispatchers, sum_traffic, traffic_delta


def _reading(intra: int, inter: int) -> dict:
    return {"dispatch": Traffic(intra, inter, 1, 1), "combine": Traffic(2 * intra, 2 * inter, 1, 1)}


def test_delta_and_sum_of_readings():
    step = traffic_delta(_reading(30, 5), _reading(10, 2))
    assert step == {"dispatch": Traffic(20, 3, 0, 0), "combine": Traffic(40, 6, 0, 0)}
    assert traffic_delta(_reading(3, 1), None) == _reading(3, 1)  # the first reading: all of it
    assert traffic_delta(None, _reading(3, 1)) is None
    with pytest.raises(ValueError, match="went down"):
        traffic_delta(_reading(1, 0), _reading(2, 0))
    total = sum_traffic([_reading(1, 2), None, _reading(10, 20)])
    assert total == {"dispatch": Traffic(11, 22, 2, 2), "combine": Traffic(22, 44, 2, 2)}
    assert sum_traffic([None, None]) is None and sum_traffic([]) is None


def test_models_without_ep_have_no_reading():
    assert model_dispatchers(torch.nn.Linear(2, 2), None) == []
    assert dispatcher_traffic([]) is None
