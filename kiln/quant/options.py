"""The `--quantize` options shared by commands that load a model (no torch import here)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kiln.quant.modes import DEFAULT_GROUP_SIZE, GROUP_SIZES, MODES

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kiln.quant.quantize import QuantReport


def add_quantize_options(parser: argparse.ArgumentParser) -> None:
    """Add `--quantize`, `--quantize-group` and `--quantize-head` to a command."""
    parser.add_argument(
        "--quantize",
        choices=MODES,
        help="weight-only quantization of the linear layers: int8 (per output channel) or int4 "
        "(per group of --quantize-group inputs)",
    )
    parser.add_argument(
        "--quantize-group",
        type=int,
        choices=GROUP_SIZES,
        default=DEFAULT_GROUP_SIZE,
        help=f"int4 group size: {', '.join(map(str, GROUP_SIZES))} (default {DEFAULT_GROUP_SIZE})",
    )
    parser.add_argument(
        "--quantize-head", action="store_true", help="quantize the LM head too (default: fp32)"
    )


def quantize_from_args(
    model: nn.Module, args: argparse.Namespace, command: str, dtype: torch.dtype | None = None
) -> QuantReport | None:
    """Apply a command's --quantize options to its loaded model and print the report line
    (`dtype`: the activations' dtype the model runs in, for the int8 kernel's timed probe)."""
    if getattr(args, "quantize", None) is None:
        return None
    import torch

    from kiln.quant.quantize import quantize_model

    report = quantize_model(
        model, args.quantize, args.quantize_group, args.quantize_head,
        probe_dtype=dtype or torch.float32,
    )  # fmt: skip
    print(f"{command}: {report.describe()}", file=sys.stderr)
    return report
