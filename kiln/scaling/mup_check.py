"""µP's coordinate check: the size of every layer's activations after a few updates, by width.

The same small model is trained for a few steps at several widths, under standard
parameterisation (SP) and under µP relative to the smallest width, with the same learning rate,
on a fixed batch of random tokens. Under µP each layer's mean |activation| stays flat across
widths; under SP the updates grow with width and so do the activations (the logits fastest).
The summary per layer is the log-log slope of activation size against width: ~0 is flat.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from kiln.model import ModelConfig, Transformer
from kiln.train.config import OptimConfig
from kiln.train.mup import apply_mup_init
from kiln.train.optim import build_optimizer

PARAMETERISATIONS = ("sp", "mup")


@dataclass
class CoordCheck:
    """Mean |activation| per layer (rows) and width (columns), for one parameterisation."""

    parameterisation: str
    widths: list[int]
    scales: dict[str, list[float]] = field(default_factory=dict)

    def slopes(self) -> dict[str, float]:
        """Per layer, the least-squares slope of log(scale) against log(width)."""
        x = [math.log(w) for w in self.widths]
        mx = sum(x) / len(x)
        out = {}
        for layer, ys in self.scales.items():
            y = [math.log(max(v, 1e-30)) for v in ys]
            my = sum(y) / len(y)
            num = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
            out[layer] = num / sum((a - mx) ** 2 for a in x)
        return out


def check_config(width: int, base: int | None, n_layer: int, seq_len: int) -> ModelConfig:
    """The checked model: Llama-style, 4 heads (head width grows with the model), 256 tokens."""
    return ModelConfig.preset(
        "tiny", vocab_size=256, block_size=seq_len, n_layer=n_layer, n_head=4, n_kv_head=4,
        n_embd=width, ff_multiple=1, mup_base_width=base,
    )  # fmt: skip


def layer_sizes(model: Transformer, idx: Tensor) -> dict[str, float]:
    """Mean |x| of the embedding output, each block's attention, MLP and output, and the logits."""
    sizes: dict[str, float] = {}
    hooks = []

    def record(name: str) -> Callable[[nn.Module, object, Tensor], None]:
        def hook(_m: nn.Module, _args: object, out: Tensor) -> None:
            sizes[name] = out.detach().abs().mean().item()

        return hook

    hooks.append(model.wte.register_forward_hook(record("embedding")))
    for i, block in enumerate(model.blocks):
        hooks.append(block.attn.register_forward_hook(record(f"attn {i}")))
        hooks.append(block.mlp.register_forward_hook(record(f"mlp {i}")))
        hooks.append(block.register_forward_hook(record(f"block {i}")))
    try:
        with torch.no_grad():
            sizes["logits"] = model(idx).abs().mean().item()
    finally:
        for h in hooks:
            h.remove()
    return sizes


def coord_check(
    widths: list[int],
    parameterisation: str,
    *,
    steps: int = 5,
    lr: float = 0.01,
    optimizer: str = "adamw",
    n_layer: int = 2,
    seq_len: int = 32,
    batch: int = 8,
    seed: int = 0,
) -> CoordCheck:
    """Train `steps` updates at each width and measure every layer (see the module docstring)."""
    base = min(widths) if parameterisation == "mup" else None
    result = CoordCheck(parameterisation, sorted(widths))
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (batch, seq_len + 1), generator=gen)
    x, y = idx[:, :-1], idx[:, 1:]
    for width in result.widths:
        torch.manual_seed(seed)
        model = Transformer(check_config(width, base, n_layer, seq_len))
        apply_mup_init(model)
        opt = build_optimizer(
            model, OptimConfig(name=optimizer, lr=lr, weight_decay=0.0), torch.device("cpu")
        )
        for _ in range(steps):
            opt.zero_grad()
            model(x, y).backward()
            opt.step()
        for layer, size in layer_sizes(model.eval(), x).items():
            result.scales.setdefault(layer, []).append(size)
    return result


def format_checks(checks: list[CoordCheck]) -> str:
    """A table: each layer's slope of log(activation) vs log(width) per parameterisation."""
    slopes = [c.slopes() for c in checks]
    head = f"{'layer':<10}" + "".join(f"{c.parameterisation + ' slope':>12}" for c in checks)
    rows = [
        f"{layer:<10}" + "".join(f"{s[layer]:>12.2f}" for s in slopes) for layer in checks[0].scales
    ]
    return "\n".join([head, *rows])


def plot_checks(checks: list[CoordCheck], path: Path, title: str) -> Path:
    """One panel per parameterisation: mean |activation| against width, a line per layer."""
    from kiln.plotting import pyplot, save_png

    plt = pyplot()
    fig, axes = plt.subplots(1, len(checks), figsize=(5.5 * len(checks), 4.2), sharey=True)
    axes = [axes] if len(checks) == 1 else list(axes)
    for ax, check in zip(axes, checks, strict=True):
        colors = plt.cm.viridis(
            [i / max(1, len(check.scales) - 1) for i in range(len(check.scales))]
        )
        for color, (layer, ys) in zip(colors, check.scales.items(), strict=True):
            ax.plot(check.widths, ys, marker="o", color=color, label=layer)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("width n_embd")
        ax.set_title({"sp": "standard parameterisation", "mup": "µP"}[check.parameterisation])
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("mean |activation| after training steps")
    axes[-1].legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=10)
    return save_png(fig, path, dpi=110)
