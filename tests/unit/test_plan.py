"""moerl.plan: model counts, expected traffic vs sampled exact counts, calibration provenance, the CLI
(table, JSON, CSV, plot, one-line errors with exit 2). The validation protocol (held-out points, twins,
misses): tests/unit/test_plan_holdout.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.common import SPECS, ModelSpec
from moerl.cli import main
from moerl.ep import ExpertPlacement, Topology
from moerl.ep.layout import Traffic
from moerl.plan import calibrate
from moerl.plan.models import MODELS
from moerl.plan.predict import Plan, best_split, predict, set_param
from moerl.plan.sensitivity import tornado
from moerl.plan.traffic import PHASES, RowBytes, exact_traffic, expected_traffic, sample_group_limited_routing

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
CAL = json.loads(calibrate.DEFAULT_OUT.read_text())


@pytest.mark.parametrize(
    "name,total,active", [("deepseek-v3", 671e9, 37e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9),
                          ("qwen3-235b-a22b", 235e9, 22e9), ("glm5-744b-a40b", 744e9, 40e9)],
)  # fmt: skip
def test_presets_match_published_sizes(name, total, active):
    m = MODELS[name]
    assert abs(m.num_params / total - 1) < 0.02
    assert abs(m.active_matmul_params / active - 1) < 0.12  # published "active" counts include embeddings


def test_bench_model_counts_equal_bench_common():
    m = MODELS["reference"]
    assert m.active_matmul_params == 1178861568  # bench/results/train_step.json spec
    assert abs(m.num_params - 6919100416) < 1e5  # norms are not counted by the planner


def test_bench_specs_are_the_planner_presets():
    for name, spec in SPECS.items():  # the two counts are written separately; they agree on these shapes
        assert spec.active_matmul_params == MODELS[name].active_matmul_params, name
    assert SPECS["tiny"].max_position_embeddings == 512
    with pytest.raises(ValueError, match="'ep-bench'.*num_kv_heads=4"):
        ModelSpec.from_shape(MODELS["ep-bench"])
    with pytest.raises(ValueError, match="attention='mla'"):
        ModelSpec.from_shape(MODELS["deepseek-v3"])


@pytest.mark.parametrize("kind", ["contiguous", "round_robin"])
def test_expected_traffic_matches_sampled_counts(kind):
    topo = Topology(16, 4)
    placement, rows = ExpertPlacement(64, topo, kind), RowBytes(256, 4)
    gen = torch.Generator().manual_seed(0)
    idx = [sample_group_limited_routing(1500, 64, 4, 4, 2, gen) for _ in range(16)]
    exact, expected = exact_traffic(idx, placement, rows), expected_traffic(placement, 1500, rows, 4, 2)
    for phase in PHASES:
        for f in Traffic.__slots__:
            mean = sum(getattr(t, f) for t in exact[phase]) / 16
            assert mean == pytest.approx(getattr(expected[phase], f), rel=0.03), (phase, f)


def test_planned_bytes_equal_the_gpu_runs_counters():
    """The stored 2-GPU points: the planner's bytes for the bench's reproduced routing equal the bytes the
    dispatchers' Traffic counters reported on the H200s; one point is recomputed from scratch here."""
    pts = [q for q in CAL["dispatch_points"] if q["method"] != "floor_a2a"]
    assert len(pts) == 16 and all(q["bytes_planned"] == q["bytes_measured"] for q in pts)
    q = next(
        x for x in pts if x["method"] == "hierarchical" and x["routing"] == "zipf" and x["hidden"] == 4096
    )
    n, g = (int(v) for v in q["topology"].split("x"))
    placement = ExpertPlacement(256, Topology(n * g, g))
    idx = [calibrate.bench_routing(4096, 256, 8, "zipf", 1000 * r + 4096 + 1) for r in range(n * g)]
    tr = exact_traffic(idx, placement, RowBytes(2 * 4096, 8))
    sent = sum(
        t.intra_node_bytes + t.inter_node_bytes for p in ("hier_dispatch", "hier_combine") for t in tr[p]
    )
    assert sent == q["bytes_measured"]


def test_calibration_records_its_sources():
    assert set(CAL["constants"]) <= set(CAL["sources"])
    assert all(0.05 < v < 1 for k, v in CAL["constants"].items() if k.endswith("fraction"))
    assert set(CAL["dates"]) == {"rollout_gpu", "train_step", "moe_layer", "ep_multi_gpu"}


def test_eager_decode_host_scale_from_the_runs_own_non_ep_decode():
    """host_scale comes from the two machines' plain eager-minus-graphs decode, not from the EP = 2 points."""
    eager = CAL["eager_decode"]
    assert eager["host_scale"] == pytest.approx(CAL["constants"]["eager_layer_s"] / eager["w1_eager_layer_s"])
    assert 1.0 < eager["host_scale"] < 3.0
    assert set(eager["decode_layer_w1_s"]) == {"alltoall", "hierarchical"}
    assert "eager_decode" in CAL["sources"]


def test_hierarchical_sends_fewer_inter_node_bytes_and_costs_less():
    flat, hier = predict(Plan(), CAL)
    assert hier.inter_node_mb_per_layer < flat.inter_node_mb_per_layer / 2
    assert hier.rollout_tok_s > flat.rollout_tok_s and hier.usd_per_episode < flat.usd_per_episode
    assert best_split(Plan(total_nodes=12, train_nodes=6), CAL)[0] in range(1, 12)
    spot = predict(set_param(Plan(), "spot_rollout", "true"), CAL)[1]
    assert spot.usd_per_episode < hier.usd_per_episode and spot.spot_availability < 1


def test_sensitivity_rows_cover_the_mission_sweeps():
    rows = tornado(Plan(), CAL)
    assert {"top_k", "placement", "rollout_ep_nodes"} <= {r["param"] for r in rows}
    swings = [r["swing"] for r in rows]
    assert swings == sorted(swings, reverse=True) and swings[0] > 0.05


def test_cli_outputs(tmp_path, capsys):
    out = {k: tmp_path / f"o.{k}" for k in ("json", "csv", "png")}
    yml = tmp_path / "p.yaml"
    yml.write_text("total_nodes: 24\ntrain_nodes: 12\n")
    rc = main(["plan", "--file", str(yml), "--sweep", "top_k=2,4", "--json", str(out["json"]),
               "--csv", str(out["csv"]), "--plot", str(out["png"])])  # fmt: skip
    assert rc == 0 and "hier/flat" in capsys.readouterr().out
    data = json.loads(out["json"].read_text())
    assert [p["plan"]["top_k"] for p in data["points"]] == [2, 4] and data["points"][0]["plan"][
        "total_nodes"
    ] == 24
    assert len(out["csv"].read_text().splitlines()) == 5 and out["png"].stat().st_size > 1000


def test_example_plan_file_runs(capsys):
    example = RESULTS.parents[1] / "docs" / "plan_example.yaml"
    assert main(["plan", "--file", str(example), "--assumptions"]) == 0
    assert "plan.spot_rollout = True" in capsys.readouterr().out


def test_cli_validate_and_sensitivity(capsys):
    assert main(["plan", "--validate"]) == 0
    out = capsys.readouterr().out
    assert "fitted" in out and "train step s, reference b16" in out
    assert main(["plan", "--preset", "mission", "--sensitivity"]) == 0
    out = capsys.readouterr().out
    assert "sensitivity of hier/flat" in out and "best split of 48 nodes" in out


@pytest.mark.parametrize(
    "argv,needle",
    [(["--preset", "nope"], "unknown preset"), (["--sweep", "bogus=1"], "unknown plan parameter"),
     (["--set", "top_kk=3"], "unknown plan parameter 'top_kk'; did you mean 'top_k'?"),
     (["--sweep", "top_k=x"], "not a valid int"), (["--set", "placement=diagonal"], "placement"),
     (["--set", "train_nodes=48"], "train_nodes"), (["--plot", "x.png"], "--plot needs a --sweep")],
)  # fmt: skip
def test_bad_input_is_one_line_exit_2(argv, needle, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_every_catalog_figure_has_a_source():
    from moerl.plan.hardware import HARDWARE

    figures = {"bf16_tflops", "fp8_tflops", "hbm_tb_s", "hbm_gb", "nvlink_gb_s", "net_gb_s", "net_message_us",
               "price_on_demand", "spot_fraction", "interruptions_per_hour", "gpus_per_node"}  # fmt: skip
    for hw in HARDWARE.values():
        assert figures <= set(hw.sources), hw.name


def test_sensitivity_marks_a_value_the_plan_refuses_as_invalid():
    rows = {r["param"]: r for r in tornado(Plan(total_nodes=15, train_nodes=9), CAL)}  # 6 rollout nodes
    assert rows["rollout_ep_nodes"]["ratio_high"] is None  # 4 nodes per replica do not divide 6
    assert rows["rollout_ep_nodes"]["ratio_low"] is None  # 1 node cannot hold the model's weights
    assert None not in (rows["top_k"]["ratio_low"], rows["top_k"]["ratio_high"])


def test_mission_recipe_preset_is_the_cluster_recipe_scenario():
    from moerl.config import load_config
    from moerl.plan.args import PRESETS

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "cluster_mission.yaml")
    p, t, r = PRESETS["mission-recipe"], cfg.trainer, cfg.rollout
    shape = MODELS[p["model"]]
    m = cfg.model
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_experts, shape.top_k) == (
        m.hidden_size,
        m.num_layers,
        m.num_heads,
        m.num_experts,
        m.top_k,
    )
    assert (shape.kv_lora_rank, shape.q_lora_rank, shape.num_dense_layers) == (
        m.kv_lora_rank,
        m.q_lora_rank,
        m.first_dense_layers,
    )
    gpus = t.gpus_per_node
    assert p["train_nodes"] == t.num_ranks // gpus and p["train_ep_nodes"] == t.ep_size // gpus
    assert p["total_nodes"] == p["train_nodes"] + r.num_workers * r.ep_size // gpus
    assert p["rollout_ep_nodes"] == r.ep_size // gpus and p["rollout_rows_per_gpu"] == r.max_slots
    assert (p["prompts_per_step"], p["group_size"]) == (t.batch_groups, r.group_size)
    assert p["prompt_len"] + p["response_len"] == 4096 and p["response_len"] == r.max_new_tokens
    assert (p["max_staleness"], p["checkpoint_every"]) == (cfg.runtime.max_staleness, t.checkpoint_every)


def test_spot_hard_losses_cost_less_with_progress_snapshots():
    from dataclasses import replace

    from moerl.plan.predict import lost_per_interruption_s

    p = replace(Plan(), spot_rollout=True, interruptions_per_hour=0.2, response_len=16384.0, notice_s=120.0)
    p = replace(p, schedule="sync")  # generation on the step's path: lost generation costs step time
    hard = replace(p, hard_loss_fraction=0.5, snapshot_tokens=64.0, keep_partial=True)
    # hand-computed: noticed half loses nothing (keep_partial), hard half loses 64 / 2 tokens of steps
    assert lost_per_interruption_s(hard, 0.02) == pytest.approx(0.5 * 64 * 0.02 / 2)
    no_snap = replace(hard, snapshot_tokens=0.0)  # a hard loss costs half a response on average
    assert lost_per_interruption_s(no_snap, 0.02) == pytest.approx(0.5 * 16384 * 0.02 / 2)
    old = lost_per_interruption_s(p, 0.02)  # notice only, no keep_partial: the earlier model
    assert old == pytest.approx((16384 * 0.02 - 120) ** 2 / (2 * 16384 * 0.02))
    h = predict(hard, CAL)[1]
    assert h.spot_lost_s > 0 and h.usd_per_episode < h.usd_per_episode_no_snapshots
    n = predict(no_snap, CAL)[1]
    assert n.usd_per_episode == pytest.approx(h.usd_per_episode_no_snapshots)
    assert n.spot_availability < h.spot_availability < 1
