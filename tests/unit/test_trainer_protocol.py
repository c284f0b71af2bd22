"""Both trainers implement ``moerl.trainer.protocol.Trainer``, and nothing outside ``moerl.trainer`` asks
which one it has (the run talks to the Protocol only)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import torch
from _tiny import tiny_model

from moerl.config import AlgorithmConfig, TrainerConfig
from moerl.trainer.distributed.group import TrainerGroup
from moerl.trainer.local import LocalTrainer
from moerl.trainer.protocol import Trainer

ROOT = Path(__file__).resolve().parents[2] / "moerl"


def _protocol_members() -> set[str]:
    names = set(Trainer.__annotations__)
    names |= {
        n
        for n, v in vars(Trainer).items()
        if not n.startswith("_") and (callable(v) or isinstance(v, property))
    }
    return names


def _init_attributes(cls: type) -> set[str]:
    """``self.X = ...`` targets in ``cls.__init__``."""
    tree = ast.parse(inspect.getsource(cls.__init__).lstrip().replace("\n    ", "\n"))
    return {
        t.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def test_local_trainer_is_a_trainer():
    torch.manual_seed(0)
    trainer = LocalTrainer(tiny_model(32), TrainerConfig(), AlgorithmConfig())
    assert isinstance(trainer, Trainer)
    missing = {n for n in _protocol_members() if not hasattr(trainer, n)}
    assert not missing, f"LocalTrainer lacks {sorted(missing)}"
    assert trainer.num_ranks == 1 and trainer.last_ep_traffic is None and len(trainer.pids) == 1


def test_trainer_group_has_every_member():
    have = set(dir(TrainerGroup)) | _init_attributes(TrainerGroup)
    missing = _protocol_members() - have
    assert not missing, f"TrainerGroup lacks {sorted(missing)}"


def test_no_isinstance_on_trainer_types_outside_the_trainer_package():
    pattern = re.compile(r"isinstance\([^)]*\b(TrainerGroup|LocalTrainer|ShardedTrainer)\b")
    hits = [
        f"{f.relative_to(ROOT.parent)}:{i}"
        for f in ROOT.rglob("*.py")
        if "trainer" not in f.relative_to(ROOT).parts[:1]
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, f"isinstance on a trainer type outside moerl/trainer: {hits}"
