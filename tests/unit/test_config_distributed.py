"""The distributed trainer's config fields: defaults, and bad combinations as ConfigErrors at load."""

import json

import pytest

from moerl.cli import main as cli_main
from moerl.config import ConfigError, load_config


def test_defaults_are_the_one_process_trainer():
    t = load_config(None).trainer
    assert (t.num_ranks, t.ep_size, t.ep_dispatcher, t.activation_checkpointing) == (1, 1, "alltoall", False)
    assert t.gpus_per_node == 8
    assert load_config(None).runtime.publish_bucket_mb == 256.0


def test_valid_sharded_layouts_load():
    cfg = load_config(
        None,
        [
            "trainer.num_ranks=4",
            "trainer.ep_size=4",
            "trainer.ep_dispatcher=hierarchical",
            "trainer.gpus_per_node=2",
            "trainer.batch_groups=8",
            "trainer.activation_checkpointing=true",
        ],
    )
    assert cfg.trainer.num_ranks == 4 and cfg.trainer.ep_size == 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.num_ranks=4", "trainer.ep_size=3"],
            r"trainer.ep_size=3 does not divide trainer.num_ranks=4",
        ),
        (["trainer.num_ranks=0"], r"trainer.num_ranks=0 is out of range"),
        (["trainer.ep_dispatcher=deepep"], r"trainer.ep_dispatcher='deepep'"),
        (
            [
                "trainer.num_ranks=6",
                "trainer.ep_size=6",
                "trainer.gpus_per_node=4",
                "trainer.batch_groups=12",
            ],
            r"trainer.ep_size=6 is not a multiple of trainer.gpus_per_node=4",
        ),
        (
            ["trainer.num_ranks=3", "trainer.batch_groups=8"],
            r"batch_groups=8 is not a multiple of trainer.num_ranks=3",
        ),
        (
            ["trainer.num_ranks=2", "trainer.ep_size=2", "model.num_experts=3", "trainer.batch_groups=2"],
            r"trainer.ep_size=2 does not divide the policy's 3 routed experts",
        ),
        (
            ["trainer.num_ranks=2", "trainer.mini_batches=2", "trainer.batch_groups=2"],
            r"not a multiple of trainer.num_ranks x trainer.mini_batches=4",
        ),
        (["runtime.publish_bucket_mb=0"], r"runtime.publish_bucket_mb=0"),
    ],
)
def test_bad_combinations_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_ep_size_is_checked_against_the_init_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 6}))
    with pytest.raises(ConfigError, match="does not divide the policy's 6 routed experts"):
        load_config(None, [f"init_from={tmp_path}", "trainer.num_ranks=4", "trainer.ep_size=4"])
    assert load_config(None, [f"init_from={tmp_path}", "trainer.num_ranks=4", "trainer.ep_size=2"])


def test_cli_reports_a_bad_layout_in_one_line_and_writes_nothing(tmp_path, capsys):
    code = cli_main(
        [
            "train",
            "--set",
            f"output_dir={tmp_path}",
            "--set",
            "trainer.num_ranks=4",
            "--set",
            "trainer.ep_size=3",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "trainer.ep_size=3" in err
    assert list(tmp_path.iterdir()) == []
