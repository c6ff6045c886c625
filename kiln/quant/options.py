"""The `--quantize` options shared by commands that load a model (no torch import here)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kiln.errors import KilnError
from kiln.quant.modes import DEFAULT_GROUP_SIZE, FP8_FORMATS, FP8_SCALINGS, GROUP_SIZES, MODES

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kiln.quant.quantize import QuantReport


def add_quantize_options(parser: argparse.ArgumentParser) -> None:
    """Add `--quantize` and its settings (group, fp8 format and scaling, head) to a command."""
    parser.add_argument(
        "--quantize",
        choices=MODES,
        help="weight-only quantization of the linear layers: int8 (per output channel), int4 "
        "(per group of --quantize-group inputs), fp8 (--quantize-fp8 format, "
        "--quantize-scaling), mxfp8 / mxfp4 (OCP MX: 32-element blocks, E8M0 scales) or nvfp4 "
        "(16-element blocks, e4m3 scales, fp32 tensor scale); the float formats are emulated "
        "(dequantize, then the matmul)",
    )
    parser.add_argument(
        "--quantize-group",
        type=int,
        choices=GROUP_SIZES,
        default=DEFAULT_GROUP_SIZE,
        help=f"int4 group size: {', '.join(map(str, GROUP_SIZES))} (default {DEFAULT_GROUP_SIZE})",
    )
    parser.add_argument(
        "--quantize-fp8",
        choices=FP8_FORMATS,
        help="fp8 element format for --quantize fp8 (default e4m3)",
    )
    parser.add_argument(
        "--quantize-scaling",
        choices=FP8_SCALINGS,
        help="fp8 scales: one per tensor, per 1x128 block of inputs or per 128x128 tile "
        "(default 128x128)",
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

    fp8_format, fp8_scaling = (
        getattr(args, "quantize_fp8", None),
        getattr(args, "quantize_scaling", None),
    )
    if args.quantize != "fp8" and (fp8_format or fp8_scaling):
        flag = "--quantize-fp8" if fp8_format else "--quantize-scaling"
        raise KilnError(
            f"{command}: {flag} applies to --quantize fp8 only, got --quantize {args.quantize}"
        )
    report = quantize_model(
        model, args.quantize, args.quantize_group, args.quantize_head,
        probe_dtype=dtype or torch.float32,
        fp8_format=fp8_format or "e4m3", fp8_scaling=fp8_scaling or "128x128",
    )  # fmt: skip
    print(f"{command}: {report.describe()}", file=sys.stderr)
    return report
