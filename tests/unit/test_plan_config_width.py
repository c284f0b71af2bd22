"""``moerl plan`` output fits 100 columns (``--wide`` adds the rest), and ``--config RUN.yaml`` plans a run
config's model, nodes and batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from moerl.cli import main
from moerl.cluster.plan_inputs import planner_model
from moerl.config import load_config
from moerl.models.config import MoeConfig
from moerl.tasks.tokenizer import load_run_tokenizer

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "configs" / "cluster_qwen3_30b_1node.yaml"


def load_config_dict(run: dict, folder: Path):
    folder.mkdir(exist_ok=True)
    (folder / "run.yaml").write_text(yaml.safe_dump(run))
    return load_config(folder / "run.yaml")


def _fits(text: str, width: int = 100) -> None:
    lines = text.splitlines()
    assert lines and max(len(line) for line in lines) <= width, max(lines, key=len)
    assert "…" not in text  # nothing cut short


def test_the_plan_fits_100_columns_and_wide_adds_the_rest(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--preset", "mission", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    _fits(text)
    for pr in json.loads(out.read_text())["points"][0]["predictions"]:  # every figure whole, on one line
        assert f"{pr['rollout_tok_s']:,.0f}" in text and f"{pr['usd_per_1000_episodes']:.2f}" in text
    assert "ms/step" not in text and "MB/layer" not in text
    assert main(["plan", "--preset", "mission", "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "ms/step" in wide and "MB/layer" in wide and max(len(x) for x in wide.splitlines()) > 100


@pytest.mark.parametrize("argv", [["--preset", "mission", "--sensitivity"], ["--validate"],
                                  ["--preset", "mission", "--sweep", "top_k=2,4"]])  # fmt: skip
def test_the_other_outputs_fit_100_columns(argv, capsys):
    assert main(["plan", *argv]) == 0
    _fits(capsys.readouterr().out)


def test_config_plans_the_run_configs_model_nodes_and_batch(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", str(QWEN), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    _fits(text)
    plan = json.loads(out.read_text())["points"][0]["plan"]
    run = yaml.safe_load(QWEN.read_text())
    assert plan["model"] == "qwen3-30b-a3b" and plan["hardware"] == "p5en"  # p5en.48xlarge trains
    assert plan["train_nodes"] == 1 and plan["total_nodes"] == 1 + 1  # 4 workers x EP 2 = one 8-GPU node
    assert plan["prompts_per_step"] == run["trainer"]["batch_groups"]
    assert plan["group_size"] == run["rollout"]["group_size"]
    assert plan["response_len"] == run["rollout"]["max_new_tokens"] and plan["spot_rollout"] is True
    assert "g6e.12xlarge: planned as p5en" in " ".join(text.split())  # the priced type is named
    assert main(["plan", "--config", str(QWEN), "--set", "prompts_per_step=64", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["points"][0]["plan"]["prompts_per_step"] == 64  # --set wins


def test_config_with_a_model_of_its_own_reads_its_config_json(tmp_path, capsys):
    arch = MoeConfig(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=128, moe_intermediate_size=512, num_experts=32,
                     num_experts_per_tok=4)  # fmt: skip
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(arch.to_hf_dict()))
    run = yaml.safe_load(QWEN.read_text())
    run["model"].update(hidden_size=1024, num_layers=8, num_heads=8, num_kv_heads=2, num_experts=32, top_k=4,
                        moe_intermediate_size=512)  # fmt: skip
    run["name"] = "mine"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    # neither a preset nor a config.json: the fresh model the run builds, the run tokenizer's vocabulary
    fresh = planner_model(load_config(tmp_path / "run.yaml"))
    assert fresh.name == "mine-model" and fresh.vocab_size == load_run_tokenizer(load_config(QWEN)).vocab_size
    assert (fresh.hidden_size, fresh.num_layers, fresh.num_experts, fresh.top_k) == (1024, 8, 32, 4)
    with_init = planner_model(load_config_dict({**run, "init_from": str(folder)}, tmp_path / "init"))
    assert with_init.vocab_size == 32000  # a config.json wins over the section
    out = tmp_path / "fresh.json"
    assert main(["plan", "--config", str(tmp_path / "run.yaml"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["points"][0]["plan"]["model"] == "mine-model"
    run["init_from"] = str(folder)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", str(tmp_path / "run.yaml"), "--json", str(out), "--assumptions"]) == 0
    assert json.loads(out.read_text())["points"][0]["plan"]["model"] == "mine-model"
    assert "plan.top_k = 4 (the model mine-model)" in capsys.readouterr().out
