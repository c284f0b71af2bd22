"""bench/e2e_gpu.py's bookkeeping: the run config of each size, and the per-step figures, medians after
step 1 and ratios read back from a run folder (the runs themselves: ``python3 bench/e2e_gpu.py --tiny``)."""

from __future__ import annotations

import json

import pytest

from bench import e2e_gpu
from moerl.config import load_config


def test_each_size_runs_a_shipped_config_overriding_only_size_steps_device_and_folder(tmp_path):
    for size, spec in e2e_gpu.SIZES.items():
        overrides = e2e_gpu.run_overrides(size, "cpu", tmp_path, steps=4)
        cfg = load_config(e2e_gpu.REPO / spec["config"], [*overrides, "runtime.mode=sync"])
        assert cfg.trainer.steps == 4 and cfg.model.device == "cpu"
        # no publish, durability, engine or rollout setting is overridden: the figures are the defaults'
        sections = {o.split("=", 1)[0].split(".")[0] for o in overrides}
        assert sections <= {"model", "trainer", "output_dir"}, sections
        assert {o.split("=", 1)[0] for o in overrides if o.startswith("trainer.")} <= {
            "trainer.steps",
            "trainer.micro_batch_size",
        }
    one_b = load_config(
        e2e_gpu.REPO / "configs/gpu_single.yaml", e2e_gpu.run_overrides("1b", "cpu", tmp_path, 4)
    )
    m = one_b.model
    assert (m.hidden_size, m.num_layers, m.num_experts, m.top_k) == (1024, 8, 64, 8)
    big = load_config(
        e2e_gpu.REPO / "configs/gpu_single.yaml", e2e_gpu.run_overrides("6.9b", "cpu", tmp_path, 4)
    )
    assert (big.model.hidden_size, big.model.num_layers, big.model.moe_intermediate_size) == (2048, 16, 1024)


def test_a_run_folder_gives_medians_of_its_steady_steps_and_ratios_to_the_parts_alone(tmp_path):
    def row(step, rollout, train, step_s, gen_s, eval_s=2e-6, final_save_s=0.0, accuracy=None):
        # every step logs a few microseconds of timing/eval_s (the timer's cost); an eval step, its accuracy
        return {
            "step": step,
            "perf/rollout_tokens_per_s": rollout,
            "perf/train_tokens_per_s": train,
            "perf/step_time_s": step_s,
            "timing/gen_s": gen_s,
            "timing/eval_s": eval_s,
            "timing/final_save_s": final_save_s,
            "eval/accuracy": accuracy,
        }

    rows = [
        row(1, 10.0, 5.0, 99.0, 90.0),  # the first: graph captures
        row(2, 10.0, 5.0, 6.0, 2.0, eval_s=0.5, accuracy=0.25),  # an eval step
        row(3, 100.0, 60.0, 5.0, 4.0),  # steady
        row(4, 80.0, 40.0, 3.0, 2.0),  # steady
        row(5, 10.0, 5.0, 45.0, 2.0, final_save_s=40.0),  # the last: the run's final save
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "worker.log").write_text("CUDA graph capture failed for key (1,)\n")
    alone = {
        "engine": {"tokens_per_s": 100.0, "gen_s": 2.0},
        "trainer": {"tokens_per_s": 100.0, "train_s": 2.0},
    }
    out = e2e_gpu.summarize_run(tmp_path, alone)
    assert out["steady_steps"] == [3, 4]
    med = out["median_steady"]
    assert (
        med["perf/rollout_tokens_per_s"] == 90.0
        and med["timing/gen_s"] == 3.0
        and med["timing/eval_s"] == 2e-6
    )
    assert (
        out["median_after_step1"]["timing/eval_s"] == 2e-6
        and out["median_after_step1"]["timing/gen_s"] == 2.0
    )
    assert out["ratios"] == {
        "rollout_tokens_per_s_over_alone": 0.9,
        "train_tokens_per_s_over_alone": 0.5,
        "step_s_over_gen_plus_train_alone": 1.0,
        "step_s_over_gen_plus_train_alone_all_after_step1": 5.5 / 4,
    }
    assert out["baseline_faults"] == []
    # a run beating its part alone by more than 10% is a baseline fault, not a result
    alone["engine"]["tokens_per_s"] = 80.0
    assert e2e_gpu.summarize_run(tmp_path, alone)["baseline_faults"] == ["rollout_tokens_per_s_over_alone"]
    # async: a step's gen_s sums overlapping groups, so no rollout ratio (and no fault from it)
    out_async = e2e_gpu.summarize_run(tmp_path, alone, "async")
    assert (
        out_async["ratios"]["rollout_tokens_per_s_over_alone"] is None and out_async["baseline_faults"] == []
    )
    assert [s["step"] for s in out["steps"]] == [1, 2, 3, 4, 5]
    assert out["capture_failed_in_folder"] == [str(tmp_path / "worker.log")]
    assert e2e_gpu.summarize_run(tmp_path / "missing", alone)["error"] == "no metrics.jsonl"


def test_resummarize_recomputes_a_result_file_from_its_per_step_rows(tmp_path):
    rows = [
        {"step": i, "perf/step_time_s": t, "perf/rollout_tokens_per_s": 50.0, "eval/accuracy": a}
        for i, t, a in [(1, 30.0, None), (2, 4.0, None), (3, 6.0, None), (4, 50.0, 0.5)]
    ]
    alone = {
        "engine": {"tokens_per_s": 100.0, "gen_s": 1.0},
        "trainer": {"tokens_per_s": 10.0, "train_s": 3.0},
    }
    stale = {"steps": rows, "steady_steps": [], "median_steady": {}, "ratios": {}, "rc": 0}
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"results": {"1b": {"alone": alone, "sync": stale}}}))
    e2e_gpu.resummarize(path)
    entry = json.loads(path.read_text())["results"]["1b"]["sync"]
    assert entry["steady_steps"] == [2, 3] and entry["rc"] == 0
    assert entry["ratios"]["step_s_over_gen_plus_train_alone"] == 5.0 / 4.0
    assert entry["ratios"]["rollout_tokens_per_s_over_alone"] == 0.5
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="no 'results'"):
        e2e_gpu.resummarize(tmp_path / "other.json")
