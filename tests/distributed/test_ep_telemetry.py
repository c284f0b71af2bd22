"""The sharded trainer's EP bytes reach the run's telemetry: ``moerl_ep_bytes_total`` and ``ep/*`` of
``metrics.jsonl`` count exactly what the ranks' dispatchers counted (``Dispatcher.traffic_by_direction``),
summed over the ranks; a run without expert parallelism reports none. An EP rollout group's leader reports
(``EPGroupEngine.ep_traffic``, its heartbeat's ``WorkerHealth.ep_traffic``) the sum of its ranks' counters.

Two steps of ``moerl train``'s ``Run`` (sync, gloo) of the tiny policy with a KL to the reference policy
(two EP models per rank: policy and reference), the dispatchers' counters read from the live ranks.
"""

from __future__ import annotations

import ep_group_cases
import ep_traffic_cases
import pytest
import torch
import train_cases
from dist_harness import run_world
from prometheus_client.parser import text_string_to_metric_families

from moerl.config import load_config
from moerl.ep.traffic import DIRECTIONS, sum_traffic
from moerl.rundir.folder import RunDir, read_jsonl
from moerl.tasks.sft import run_sft
from moerl.train import Run
from moerl.trainer.distributed.group import TrainerGroup

EP_RUNS = {  # name -> overrides
    # 4 EP ranks on 2 simulated nodes of 2 (hierarchical dispatcher): both link classes carry bytes
    "R4-EP4-hier": [
        "trainer.num_ranks=4",
        "trainer.ep_size=4",
        "trainer.ep_dispatcher=hierarchical",
        "trainer.gpus_per_node=2",
    ],
}
NO_EP_RUNS = {"R1": ["trainer.num_ranks=1"]}


@pytest.fixture(scope="module")
def init(tmp_path_factory):
    """A 3-step SFT start (the bytes do not depend on how well it learned; 8 held-out prompts)."""
    root = tmp_path_factory.mktemp("ep_telemetry")
    sft = ["sft.steps=3", "sft.batch_size=8", "sft.num_examples=64", "sft.warmup_steps=1", "task.num_eval=8"]
    torch.manual_seed(0)
    run_sft(load_config(None, [*train_cases.TINY_MOE, *sft]), out_dir=str(root / "init"))
    return root, root / "init"


def _run(init, name: str, steps: int, *overrides: str) -> dict:
    """``steps`` steps of a run; its metrics, the scraped EP counter and each rank's dispatcher counters."""
    root, folder = init
    cfg = train_cases.run_config(
        root, folder, name, f"trainer.steps={steps}", "trainer.checkpoint_every=0", "algorithm.kl_coef=0.01",
        *overrides,
    )  # fmt: skip
    run_dir = RunDir.create(cfg)
    run = Run(cfg, run_dir, live=False)
    run.start(checkpoint=None)
    try:
        for _ in range(steps):
            run.step()
        ranks = run.trainer.ep_traffic_totals() if isinstance(run.trainer, TrainerGroup) else None
        scrape = run.telemetry.exporter.render().decode()
    finally:
        run.close()
        run.close_trainer()
    counter = {
        (s.labels["link"], s.labels["direction"]): s.value
        for family in text_string_to_metric_families(scrape)
        if family.name == "moerl_ep_bytes"
        for s in family.samples
        if s.name == "moerl_ep_bytes_total"
    }
    return {"metrics": read_jsonl(run_dir.metrics), "counter": counter, "ranks": ranks}


@pytest.mark.parametrize("name", list(EP_RUNS))
def test_ep_bytes_equal_the_dispatchers_counters(init, name):
    got = _run(init, name, 2, *EP_RUNS[name])
    ranks = got["ranks"]
    assert len(ranks) == 4 and all(r is not None for r in ranks)
    want = {  # the dispatchers' own counters, summed over the ranks
        (link, d): sum(getattr(r[d], f"{link}_node_bytes") for r in ranks)
        for link in ("intra", "inter")
        for d in DIRECTIONS
    }
    print(f"{name}: moerl_ep_bytes_total {got['counter']}, dispatchers {want}")
    assert got["counter"] == {k: float(v) for k, v in want.items()}
    assert min(want.values()) > 0, want  # every link class and direction carried bytes
    first, last = got["metrics"]
    for link in ("intra", "inter"):  # cumulative: the last record holds the whole run's bytes
        key = f"ep/{link}_node_bytes"
        assert last[key] == want[link, "dispatch"] + want[link, "combine"]
        assert 0 < first[key] < last[key]  # step 1's bytes, then steps 1 + 2


@pytest.mark.parametrize("name", list(NO_EP_RUNS))
def test_run_without_ep_reports_no_ep_bytes(init, name):
    got = _run(init, name, 1, *NO_EP_RUNS[name])
    assert got["ranks"] is None
    assert set(got["counter"].values()) == {0.0} and len(got["counter"]) == 4
    assert all(m["ep/intra_node_bytes"] is None and m["ep/inter_node_bytes"] is None for m in got["metrics"])


@pytest.mark.parametrize("world", [2])
def test_ep_rollout_group_reports_the_sum_of_its_ranks_counters(world):
    results = run_world(
        ep_group_cases.run_traffic_case, world, preload=("ep_engine_cases", "ep_group_cases"), timeout_s=120
    )
    group = results[0]["group"]
    want = sum_traffic(r["own"] for r in results)  # each rank's dispatcher, read on that rank
    print(f"EP rollout group of {world}: heartbeat total {group}, ranks' dispatchers {want}")
    assert group == want
    assert all(r["own"][d].intra_node_bytes > 0 for r in results for d in DIRECTIONS)  # every rank sent


def test_dispatchers_split_every_sent_byte_by_direction():
    """Forward dispatch counts as ``dispatch`` and forward combine as ``combine``; the backward of combine
    sends towards the experts (``dispatch``) and the backward of dispatch back to the tokens (``combine``);
    the two directions add up to everything the links sent, backward passes included."""
    results = run_world(ep_traffic_cases.run_directions, 4, 2, preload=("ep_traffic_cases",), timeout_s=120)
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert r["forward"] == {"dispatch": r["dispatched"], "combine": r["combined"]}, (rank, name)
            after = r["after"]
            assert after["dispatch"] + after["combine"] == r["total"] == r["links"], (rank, name)
            for d in DIRECTIONS:  # the backward pass moved bytes on both link classes, in both directions
                grown = after[d] - r["forward"][d]
                assert grown.intra_node_bytes > 0 and grown.inter_node_bytes > 0, (rank, name, d, grown)
