"""Architecture names and rotary scaling: the parts of a model config that ``moerl.models.config`` and
the Hugging Face translation (``moerl.models.hf_config``) share."""

from __future__ import annotations

from dataclasses import dataclass

from moerl.choices import SUPPORTED_ARCHITECTURES
from moerl.configlib import ConfigError, check_choice, check_range

MODEL_TYPES: dict[str, str] = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
"""Model family -> its ``architectures[0]`` name."""


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture (or a feature of one) that moerl does not implement."""


@dataclass(kw_only=True, slots=True)
class RopeScaling:
    """Rotary-embedding context extension (Hugging Face ``rope_parameters`` minus ``rope_theta``).

    ``linear``: position interpolation, inv_freq / factor (Chen et al. 2023, arXiv:2306.15595).
    ``yarn``: NTK-by-parts interpolation with attention temperature (Peng et al. 2023,
    arXiv:2309.00071, Eq. 17-20), with DeepSeek's ``mscale``/``mscale_all_dim`` variant.
    """

    rope_type: str = "default"
    """default, linear or yarn."""
    factor: float = 1.0
    """Context extension factor s (> 0)."""
    original_max_position_embeddings: int | None = None
    """Pre-training context length L (yarn)."""
    beta_fast: float = 32.0
    """YaRN: rotations above which a dimension is extrapolated (alpha in the paper is beta_slow)."""
    beta_slow: float = 1.0
    """YaRN: rotations below which a dimension is fully interpolated."""
    mscale: float | None = None
    """DeepSeek YaRN: numerator multiplier of the cos/sin temperature."""
    mscale_all_dim: float | None = None
    """DeepSeek YaRN: denominator multiplier, and the softmax scale becomes scale * mscale(s, this)^2."""
    attention_factor: float | None = None
    """Explicit cos/sin multiplier; ``None`` derives it from factor/mscale."""
    truncate: bool = True
    """YaRN: round the correction range to integers."""

    def __post_init__(self) -> None:
        check_choice("rope_scaling.rope_type", self.rope_type, ["default", "linear", "yarn"])
        check_range("rope_scaling.factor", self.factor, 0.0, lo_open=True)
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise ConfigError(
                "rope_scaling.original_max_position_embeddings is required for rope_type='yarn'"
            )
