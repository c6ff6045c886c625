"""The Transformer LM family: `ModelConfig` (switches and presets) and `Transformer` (the module)."""

from typing import TYPE_CHECKING, Any

from kiln.model.config import (
    PRESETS,
    MLAConfig,
    ModelConfig,
    ModelConfigError,
    MoEConfig,
    RopeScaling,
)

if TYPE_CHECKING:
    from kiln.model.transformer import Transformer

__all__ = ["PRESETS", "MLAConfig", "MoEConfig", "ModelConfig", "ModelConfigError", "RopeScaling"]
__all__ += ["Transformer"]


def __getattr__(name: str) -> Any:
    # torch is imported on first use of Transformer, so the CLI and config tools start fast.
    if name == "Transformer":
        from kiln.model.transformer import Transformer

        return Transformer
    raise AttributeError(f"module 'kiln.model' has no attribute {name!r}")
