"""Write this example's data in verl's RL parquet format: train.parquet (200 rows) and val.parquet (20).

Each row is what verl's data preprocessing scripts write (e.g. its examples/data_preprocess/gsm8k.py):
``data_source``, ``prompt`` (a list of chat messages), ``ability``, ``reward_model`` ({style, ground_truth})
and ``extra_info`` (here: the row's split and index, and the partial credit the reward gives a wrong
number). Problems are 2-digit additions; the validation problems never appear in training.

Run from anywhere: ``python examples/verl_format/make_data.py``; it writes beside itself.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent


def row(a: int, b: int, split: str, index: int) -> dict:
    """One verl-format row for the problem ``a + b``."""
    return {
        "data_source": "moerl/addition",
        "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "partial_credit": 0.1},
    }


def main() -> None:
    rng = random.Random(0)
    problems = rng.sample([(a, b) for a in range(10, 100) for b in range(10, 100)], 220)
    train = [row(a, b, "train", i) for i, (a, b) in enumerate(problems[:200])]
    val = [row(a, b, "test", i) for i, (a, b) in enumerate(problems[200:])]
    pq.write_table(pa.Table.from_pylist(train), HERE / "train.parquet")
    pq.write_table(pa.Table.from_pylist(val), HERE / "val.parquet")


if __name__ == "__main__":
    main()
