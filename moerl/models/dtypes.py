"""Parameter dtypes by the names the config uses (``moerl.choices.DTYPE_NAMES``)."""

from __future__ import annotations

import torch

from moerl.choices import DTYPE_NAMES

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
assert tuple(_DTYPES) == DTYPE_NAMES  # one list of names


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``float32`` or ``bfloat16``).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r}; choose one of {list(DTYPE_NAMES)}")
    return _DTYPES[name]
