"""Triton kernels (flash attention). Triton is optional: kiln imports it only here, on first use."""

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def triton_available() -> bool:
    """Whether triton is installed (the model falls back to SDPA when it isn't)."""
    return importlib.util.find_spec("triton") is not None


def flash_attention(
    q: "torch.Tensor",
    k: "torch.Tensor",
    v: "torch.Tensor",
    causal: bool = True,
    scale: float | None = None,
) -> "torch.Tensor":
    """Exact attention in Triton: q (B, H, T, D), k/v (B, H_kv, T, D), H % H_kv == 0 -> (B, H, T, D).

    Same result and layout as torch SDPA (scale defaults to 1/sqrt(D)), differentiable, without
    materialising the T×T scores. Raises ValueError naming the argument for inputs the kernels
    can't take (dtype, head dim, layout, CPU tensors outside TRITON_INTERPRET=1), ImportError
    when triton is not installed.
    """
    if not triton_available():
        raise ImportError(
            "kiln.kernels.flash_attention needs triton: pip install 'kiln[kernels]' "
            "(or use attention_backend='sdpa')"
        )
    # Imported here so `import kiln.kernels` works without triton and so TRITON_INTERPRET is
    # read when the kernels are first needed, not when kiln is imported.
    from kiln.kernels.attention import flash_attention as _flash_attention

    return _flash_attention(q, k, v, causal=causal, scale=scale)
