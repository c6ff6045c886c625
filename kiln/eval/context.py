"""Bits per byte by context length and by position: the length-extrapolation picture.

For each context length L the same first N tokens of a text are cut into independent chunks of
L tokens (a chunk's first token has no context and is not scored); every other token is scored
with the context its chunk gives it. bpb(L) = nats / (ln 2 · bytes of the scored tokens), and
within each L by position bucket [2^i, 2^(i+1)) so a reader sees where loss rises past the
trained length. A RoPE model is rebuilt with a block size that fits the longest context (plain
RoPE extrapolates; `rope_scaling` swaps in one of the scaling types for the extension).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kiln.errors import KilnError
from kiln.eval.scoring import TextEncoder
from kiln.io import open_binary
from kiln.model import RopeScaling, Transformer

LOGITS_CHUNK = 256  # positions per head matmul, so long contexts never hold (L, V) fp32 logits


@dataclass(frozen=True)
class ContextCurve:
    """bpb by context length, and by position bucket within each length."""

    source: str
    n_tokens: int  # tokens read (each length scores its multiple-of-L prefix)
    rope_scaling: str | None
    bpb: dict[int, float]  # context length -> bits per byte
    buckets: dict[int, list[tuple[int, int, float]]]  # length -> [(lo, hi, bpb)] positions lo..hi-1

    def to_dict(self) -> dict[str, Any]:
        """Plain data for --out JSON."""
        return {
            "source": self.source, "n_tokens": self.n_tokens, "rope_scaling": self.rope_scaling,
            "bpb": {str(k): v for k, v in self.bpb.items()},
            "position_buckets": {
                str(k): [{"positions": [lo, hi], "bpb": b} for lo, hi, b in v]
                for k, v in self.buckets.items()
            },
        }  # fmt: skip

    def table(self) -> str:
        """A printable table: one row per context length."""
        lines = [f"bits per byte by context length ({self.source}, {self.n_tokens:,} tokens)"]
        for length, bpb in self.bpb.items():
            last = self.buckets[length][-1]
            lines.append(
                f"  context {length:>6}  bpb {bpb:.4f}   last positions {last[0]}-{last[1] - 1}: {last[2]:.4f}"
            )
        return "\n".join(lines)


def parse_contexts(text: str) -> list[int]:
    """'256,512,1024' -> [256, 512, 1024] (sorted, each >= 2), or a clear error."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise KilnError(
            f"--context {text!r}: expected comma-separated integers like 256,512"
        ) from None
    if not values or values[0] < 2:
        raise KilnError(f"--context {text!r}: every context length must be >= 2")
    return values


def parse_rope_scaling(text: str, trained_len: int) -> RopeScaling:
    """'yarn:4' -> RopeScaling(type='yarn', factor=4, original_max_seq_len=trained_len)."""
    kind, _, factor = text.partition(":")
    try:
        return RopeScaling(type=kind, factor=float(factor or 1), original_max_seq_len=trained_len)
    except ValueError as exc:  # ModelConfigError and float() alike
        raise KilnError(
            f"--rope-scaling {text!r}: {exc} (expected TYPE:FACTOR, e.g. yarn:4)"
        ) from None


def with_context(
    model: Transformer, block_size: int, rope_scaling: RopeScaling | None
) -> Transformer:
    """The same weights with a larger block size (RoPE only) and optionally a RoPE scaling."""
    cfg = model.cfg
    if block_size <= cfg.block_size and rope_scaling is None:
        return model
    if cfg.pos_emb != "rope":
        raise KilnError(
            f"context {block_size} exceeds block_size {cfg.block_size}, and learned absolute "
            "positions cannot extend; use contexts up to the block size"
        )
    new_cfg = dataclasses.replace(
        cfg, block_size=max(block_size, cfg.block_size),
        rope_scaling=rope_scaling if rope_scaling is not None else cfg.rope_scaling,
    )  # fmt: skip
    param = next(model.parameters())
    with torch.device("meta"):
        extended = Transformer(new_cfg)
    extended.to_empty(device=param.device)
    extended.load_state_dict(model.state_dict())
    extended.init_rope()
    return extended.to(param.dtype).eval()


def read_text_prefix(path: str | os.PathLike[str], max_bytes: int) -> str:
    """The first max_bytes of a (possibly compressed) text file, cut at a character boundary."""
    with open_binary(path) as handle:
        data = handle.read(max_bytes)
    return data.decode("utf-8", errors="ignore")  # only a cut final character can be invalid


@torch.inference_mode()
def token_nll(model: Transformer, chunks: Tensor) -> Tensor:
    """Next-token NLL (nats) of chunks (B, L) at positions 1..L-1 -> (B, L-1)."""
    h = model.hidden(chunks[:, :-1])  # (B, L-1, C)
    out = []
    for start in range(0, h.size(1), LOGITS_CHUNK):
        logits = model.logits(h[:, start : start + LOGITS_CHUNK]).float()  # (B, l, V)
        targets = chunks[:, 1 + start : 1 + start + LOGITS_CHUNK]
        out.append(-logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0])
    return torch.cat(out, dim=1)


def context_curve(
    model: Transformer,
    tok: TextEncoder,
    path: str | os.PathLike[str],
    contexts: list[int],
    n_tokens: int = 32768,
    batch_size: int = 8,
    rope_scaling: str | None = None,
) -> ContextCurve:
    """bpb of the first n_tokens of `path` at each context length (and by position bucket)."""
    if n_tokens < contexts[-1]:
        raise KilnError(
            f"--context-tokens {n_tokens} is less than the longest context {contexts[-1]}"
        )
    text = read_text_prefix(path, max_bytes=8 * n_tokens)  # ~4 bytes a token in English BPE
    ids = tok.encode_ordinary(text)[:n_tokens]
    if len(ids) < contexts[-1]:
        raise KilnError(f"{path}: {len(ids)} tokens, fewer than the longest context {contexts[-1]}")
    scaling = parse_rope_scaling(rope_scaling, model.cfg.block_size) if rope_scaling else None
    model = with_context(model.eval(), contexts[-1], scaling)
    device = next(model.parameters()).device
    all_ids = torch.tensor(ids)
    token_bytes = torch.zeros(int(all_ids.max()) + 1, dtype=torch.long)
    for t in all_ids.unique().tolist():
        token_bytes[t] = len(tok.decode_bytes([t]))
    bpb: dict[int, float] = {}
    buckets: dict[int, list[tuple[int, int, float]]] = {}
    for length in contexts:
        chunks = all_ids[: len(ids) // length * length].view(-1, length)  # (n, L)
        nll = torch.cat([
            token_nll(model, chunks[i : i + batch_size].to(device)).cpu()
            for i in range(0, chunks.size(0), batch_size)
        ])  # (n, L-1)  # fmt: skip
        nbytes = token_bytes[chunks[:, 1:]].double()  # (n, L-1)
        bpb[length] = float(nll.double().sum() / (math.log(2) * nbytes.sum()))
        buckets[length] = _position_buckets(nll.double(), nbytes, length)
    label = rope_scaling or (f"{model.cfg.rope_scaling.type}" if model.cfg.rope_scaling else None)
    return ContextCurve(os.fspath(path), len(ids), label, bpb, buckets)


def _position_buckets(nll: Tensor, nbytes: Tensor, length: int) -> list[tuple[int, int, float]]:
    """bpb over positions [2^i, 2^(i+1)) (position p predicts token p from p tokens of context)."""
    out = []
    lo = 1
    while lo < length:
        hi = min(2 * lo, length)
        cols = slice(lo - 1, hi - 1)  # column j scores position j + 1
        out.append((lo, hi, float(nll[:, cols].sum() / (math.log(2) * nbytes[:, cols].sum()))))
        lo = hi
    return out


def plot_context_curves(curves: list[ContextCurve], png: str | Path, trained_len: int) -> Path:
    """bpb against context length (left) and against position at the longest length (right)."""
    from kiln.plotting import pyplot, save_png

    fig, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4), dpi=120)
    for curve in curves:
        name = curve.rope_scaling or "rope (no scaling)"
        left.plot(list(curve.bpb), list(curve.bpb.values()), "o-", label=name)
        length = max(curve.buckets)  # the longest context shows where the loss goes
        bucket = curve.buckets[length]
        right.plot([hi - 1 for _, hi, _ in bucket], [b for *_, b in bucket], ".-",
                   label=f"{name}, L={length}", linewidth=1)  # fmt: skip
    for ax, xlabel in ((left, "context length (tokens)"), (right, "position in context")):
        ax.set_xscale("log", base=2)
        ax.axvline(trained_len, color="grey", linestyle=":", label=f"trained length {trained_len}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("bits per byte")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    left.set_title("kiln: bpb by context length")
    right.set_title("kiln: bpb by position (longest context)")
    return save_png(fig, png)


def run_context_curves(
    model: Transformer, tok: TextEncoder, args: Any
) -> tuple[dict[str, Any], str]:
    """`kiln eval --bpb FILE --context ...`: one curve per --rope-scaling entry, the table, the plot."""
    contexts = parse_contexts(args.context)
    scalings = [None if s in ("", "none") else s for s in (args.rope_scaling or "none").split(",")]
    trained = model.cfg.block_size
    curves = [
        context_curve(model, tok, args.bpb, contexts, args.context_tokens, args.batch_size, s)
        for s in scalings
    ]
    table = "\n".join(f"[{c.rope_scaling or 'rope (no scaling)'}] " + c.table() for c in curves)
    doc: dict[str, Any] = {"trained_block_size": trained, "curves": [c.to_dict() for c in curves]}
    if args.plot is not None:
        doc["plot"] = str(plot_context_curves(curves, args.plot, trained))
        table += f"\nwrote {args.plot}"
    return doc, table
