"""fp8 training matmuls, emulated: quantize → dequantize around each linear layer's matmuls.

`convert_for_fp8_training(model, recipe)` swaps the model's `nn.Linear` layers (the head only if
asked) for `Fp8TrainLinear`, which keeps the fp32 master weight and, in every forward and
backward, rounds the matmul operands to fp8 with `kiln.quant.formats` (exact casts, saturating)
before an ordinary fp32/bf16 matmul. On a CPU that is what fp8 training can be: the numbers of
fp8, not its speed. Recipes:

- "tensor": dynamic per-tensor scales (amax of the tensor now): activations and weights e4m3,
  gradients of the output e5m2 (the range they need) — the classic FP8-LM / Transformer Engine
  recipe without delayed scaling.
- "delayed": as "tensor", but each scale comes from the max amax over the last 16 steps
  (Transformer Engine's delayed scaling); a value above it saturates.
- "blockwise": DeepSeek-V3's fine-grained scaling: activations and output gradients per 1×128
  block of their inputs, weights per 128×128 tile, everything e4m3.

`train.fp8` in a `kiln train` config names these recipes by their scaling: "tensor",
"tensor_delayed" (= "delayed") and "block" (= "blockwise"); `enable_fp8_training` converts the
model and picks the matmul backend (`select_backend`): on a CUDA device with fp8 tensor cores
(compute capability 8.9+, torch with `_scaled_mm`) the per-tensor recipes run their three
matmuls as `torch._scaled_mm` on real fp8 operands; everywhere else (and "block", for which
torch has no stable block-scaled `_scaled_mm`) they run as the exact emulation above.

Simplifications against the papers, on purpose: the weight-gradient matmul reuses the forward's
quantized operands (DeepSeek-V3 re-tiles them along the other dimension), and the optimizer,
master weights and the rest of the model (norms, attention scores) stay in fp32/bf16.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kiln.errors import KilnError
from kiln.quant import formats
from kiln.quant.formats import E4M3, E5M2, Minifloat

RECIPES = ("tensor", "delayed", "blockwise")
# train.fp8's names for the recipes ("off": no conversion)
TRAIN_MODES = {"off": None, "tensor": "tensor", "tensor_delayed": "delayed", "block": "blockwise"}
BACKENDS = ("emulated", "scaled_mm")
TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
AMAX_HISTORY = 16


def qdq(x: Tensor, fmt: Minifloat, scaling: str, amax: Tensor | None = None) -> Tensor:
    """x (..., K) rounded through fp8 and back: per tensor (scale from amax if given) or per block."""
    shape = x.shape
    x2 = x.detach().float().reshape(-1, shape[-1])
    if scaling == "tensor":
        a = x2.abs().amax() if amax is None else amax
        scale = (a / fmt.max_normal).clamp(min=torch.finfo(torch.float32).tiny)
        # torch's own cast is bit-identical to formats.encode in range (tests/quant/test_formats)
        # and much faster; the clamp gives e5m2 the saturation torch's e5m2 cast lacks.
        y = (x2 / scale).clamp(-fmt.max_normal, fmt.max_normal)
        out = y.to(TORCH_FP8[fmt.name]).float() * scale
    else:  # formats.quantize_fp8's blocks and scales, with torch's cast (tested bit-identical)
        out = _block_qdq(x2, fmt, 1 if scaling == "1x128" else formats.FP8_BLOCK)
    return out.reshape(shape).to(x.dtype)


def _block_qdq(x: Tensor, fmt: Minifloat, rows: int) -> Tensor:
    """x (N, K) through fp8 with one scale per rows × 128 block (zero-padded at the edges)."""
    N, K = x.shape
    block = formats.FP8_BLOCK
    Np, Kp = -(-N // rows) * rows, -(-K // block) * block
    b = torch.nn.functional.pad(x, (0, Kp - K, 0, Np - N)).reshape(Np // rows, rows, -1, block)
    tiny = torch.finfo(torch.float32).tiny
    scale = (b.abs().amax(dim=(1, 3)) / fmt.max_normal).clamp(min=tiny)[:, None, :, None]
    y = (b / scale).clamp(-fmt.max_normal, fmt.max_normal).to(TORCH_FP8[fmt.name]).float()
    return (y * scale).reshape(Np, Kp)[:N, :K]


def scale_of(t: Tensor, fmt: Minifloat, amax: Tensor | None = None) -> Tensor:
    """The per-tensor scale s with t / s filling fmt's range (fp32 scalar)."""
    a = t.detach().abs().amax().float() if amax is None else amax.float()
    return (a / fmt.max_normal).clamp(min=torch.finfo(torch.float32).tiny)


def to_fp8(t: Tensor, fmt: Minifloat, scale: Tensor) -> Tensor:
    """t / scale as torch's fp8 dtype, saturating (what `_scaled_mm` multiplies)."""
    y = (t.detach().float() / scale).clamp(-fmt.max_normal, fmt.max_normal)
    return y.to(TORCH_FP8[fmt.name])


def scaled_mm(a: Tensor, b: Tensor, sa: Tensor, sb: Tensor, dtype: torch.dtype) -> Tensor:
    """(a · sa) @ (b · sb) on fp8 tensor cores; a (M, K) row-major, b (K, N) made column-major."""
    b = b.t().contiguous().t()  # cuBLASLt's fp8 GEMM wants the second operand column-major
    out_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
    return torch._scaled_mm(a.contiguous(), b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


class _ScaledMmMatmul(torch.autograd.Function):
    """As `_Fp8Matmul` with per-tensor scales, on real fp8 operands (`torch._scaled_mm`, CUDA)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, layer: Fp8TrainLinear) -> Tensor:  # type: ignore[override]
        """y = x8 @ w8ᵀ, rescaled."""
        x2 = x.reshape(-1, x.size(-1))
        sx, sw = layer.scale(x2, "x", E4M3), layer.scale(w, "w", E4M3)
        x8, w8 = to_fp8(x2, E4M3, sx), to_fp8(w, E4M3, sw)
        ctx.save_for_backward(x8, w8, sx, sw)
        ctx.layer, ctx.shape, ctx.dtype = layer, x.shape, x.dtype
        y = scaled_mm(x8, w8.t(), sx, sw, x.dtype)
        return y.reshape(*x.shape[:-1], w.size(0)).to(x.dtype)

    @staticmethod
    def backward(ctx, gy: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        """dx = g8 @ w8, dw = g8ᵀ @ x8, the output gradient in e5m2."""
        x8, w8, sx, sw = ctx.saved_tensors
        layer: Fp8TrainLinear = ctx.layer
        g2 = gy.reshape(-1, gy.size(-1))
        sg = layer.scale(g2, "g", E5M2)
        g8 = to_fp8(g2, E5M2, sg)
        gx = scaled_mm(g8, w8, sg, sw, ctx.dtype).reshape(ctx.shape).to(ctx.dtype)
        gw = scaled_mm(g8.t().contiguous(), x8, sg, sx, torch.float32)
        return gx, gw.to(layer.weight.dtype), None


class _Fp8Matmul(torch.autograd.Function):
    """y = qdq(x) @ qdq(w)ᵀ; dx = qdq(dy) @ qdq(w), dw = qdq(dy)ᵀ @ qdq(x)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, layer: Fp8TrainLinear) -> Tensor:  # type: ignore[override]
        """The forward matmul on fp8-rounded operands."""
        xq = layer.round(x, "x", E4M3, layer.act_scaling)
        wq = layer.round(w, "w", E4M3, layer.weight_scaling)
        ctx.save_for_backward(xq, wq)
        ctx.layer = layer
        return xq @ wq.to(xq.dtype).T

    @staticmethod
    def backward(ctx, gy: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        """Both gradient matmuls on the fp8-rounded output gradient."""
        xq, wq = ctx.saved_tensors
        layer: Fp8TrainLinear = ctx.layer
        fmt = E4M3 if layer.recipe == "blockwise" else E5M2
        gq = layer.round(gy, "g", fmt, layer.act_scaling)
        gx = gq @ wq.to(gq.dtype)
        gw = gq.reshape(-1, gq.size(-1)).T.float() @ xq.reshape(-1, xq.size(-1)).float()
        return gx, gw.to(wq.dtype), None


class Fp8TrainLinear(nn.Linear):
    """An `nn.Linear` whose matmuls see fp8-rounded operands (emulated); the weight stays fp32."""

    def __init__(self, linear: nn.Linear, recipe: str, backend: str = "emulated") -> None:
        if recipe not in RECIPES:
            raise KilnError(
                f"fp8 training recipe must be one of {', '.join(RECIPES)}, got {recipe!r}"
            )
        super().__init__(linear.in_features, linear.out_features, linear.bias is not None)
        self.weight, self.bias = linear.weight, linear.bias  # the same parameters (ties kept)
        self.recipe, self.backend = recipe, backend
        if backend not in BACKENDS or (backend == "scaled_mm" and recipe == "blockwise"):
            raise KilnError(f"fp8 backend {backend!r} does not run recipe {recipe!r}")
        self.act_scaling = "1x128" if recipe == "blockwise" else "tensor"
        self.weight_scaling = "128x128" if recipe == "blockwise" else "tensor"
        for name in ("x", "w", "g"):  # delayed scaling: the last AMAX_HISTORY amaxes
            self.register_buffer(f"amax_{name}", torch.zeros(AMAX_HISTORY), persistent=False)
        self.register_buffer("amax_seen", torch.zeros(3, dtype=torch.long), persistent=False)

    def delayed_amax(self, t: Tensor, which: str) -> Tensor:
        """Delayed scaling: the max amax of the last AMAX_HISTORY steps (now, the first time)."""
        history = getattr(self, f"amax_{which}")
        slot = "xwg".index(which)
        now = t.detach().abs().amax().float()
        seen = int(self.amax_seen[slot])
        amax = now if seen == 0 else history[: min(seen, AMAX_HISTORY)].max()
        history[seen % AMAX_HISTORY] = now
        self.amax_seen[slot] += 1
        return amax

    def round(self, t: Tensor, which: str, fmt: Minifloat, scaling: str) -> Tensor:
        """t through fp8, with this layer's recipe (delayed scales kept per operand)."""
        if self.recipe != "delayed":
            return qdq(t, fmt, scaling)
        return qdq(t, fmt, "tensor", self.delayed_amax(t, which))

    def scale(self, t: Tensor, which: str, fmt: Minifloat) -> Tensor:
        """The per-tensor scale of an operand (`_scaled_mm`'s), delayed if the recipe says so."""
        return scale_of(t, fmt, self.delayed_amax(t, which) if self.recipe == "delayed" else None)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., K) -> (..., N) through the emulated fp8 matmul."""
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        matmul = _ScaledMmMatmul if self.backend == "scaled_mm" else _Fp8Matmul
        with torch.autocast(x.device.type, enabled=False):
            y = matmul.apply(x, self.weight, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        """Shown by print(model)."""
        return f"{super().extra_repr()}, fp8={self.recipe} ({self.backend})"


def convert_for_fp8_training(
    model: nn.Module, recipe: str, include_head: bool = False, backend: str = "emulated"
) -> int:
    """Swap the model's linear layers for `Fp8TrainLinear` in place; how many were swapped."""
    if recipe not in RECIPES:
        raise KilnError(f"fp8 training recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    head = getattr(model, "lm_head", None)
    targets = [
        name
        for name, m in model.named_modules()
        if type(m) is nn.Linear and (include_head or m is not head)
    ]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8TrainLinear(getattr(parent, child), recipe, backend))
    return len(targets)


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` multiplies fp8 natively: CUDA compute capability 8.9+ (Ada, Hopper, …)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return tuple(torch.cuda.get_device_capability(device)) >= (8, 9)


def select_backend(recipe: str, device: torch.device) -> tuple[str, str]:
    """(backend, why): `_scaled_mm` where the device and recipe allow it, else the emulation."""
    if not fp8_tensor_cores(device):
        return "emulated", f"{device.type} has no fp8 tensor cores (needs CUDA capability 8.9+)"
    if recipe == "blockwise":
        return "emulated", "block scaling has no stable torch._scaled_mm path"
    return "scaled_mm", f"torch._scaled_mm on {torch.cuda.get_device_name(device)}"


def enable_fp8_training(model: nn.Module, mode: str, device: torch.device) -> dict[str, object]:
    """Apply `train.fp8 = mode` to the model in place; what was done, for the log and metrics."""
    if mode not in TRAIN_MODES:
        raise KilnError(f"train.fp8 must be one of {', '.join(TRAIN_MODES)}; got {mode!r}")
    recipe = TRAIN_MODES[mode]
    if recipe is None:
        return {"mode": "off"}
    backend, why = select_backend(recipe, device)
    layers = convert_for_fp8_training(model, recipe, backend=backend)
    return {"mode": mode, "recipe": recipe, "backend": backend, "layers": layers, "why": why}
