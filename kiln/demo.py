"""`kiln demo`: the main job on the embedded TinyStories corpus (for now: train a tokenizer)."""

from __future__ import annotations

import argparse
import gzip
import sys
import time
from importlib import resources
from pathlib import Path

from kiln.errors import KilnError

DEMO_SAMPLE = "Once upon a time, a little robot named Kiln baked 3 loaves of bread. It's warm!"


def embedded_corpus(split: str = "train") -> Path:
    """Path of the embedded TinyStories split (`train` or `valid`), gzip-compressed."""
    path = resources.files("kiln") / "assets" / f"tinystories_{split}.txt.gz"
    return Path(str(path))


def run_demo(args: argparse.Namespace) -> int:
    """Train a tokenizer on the embedded corpus, save it under a run folder and report on it."""
    from kiln.tokenizer import train_bpe
    from kiln.tokenizer.inspect import (
        inspect_text,
        longest_tokens,
        render_html,
        render_terminal,
        write_html,
    )
    from kiln.tokenizer.train import format_report

    out = Path(args.out) if args.out else Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    target = out / "tokenizer.json"
    if target.exists() and not args.force:
        raise KilnError(f"{target} already exists; pass --force to replace it")
    corpus = embedded_corpus("train")
    print(f"kiln demo: training a {args.vocab_size:,}-token byte-level BPE on {corpus.name}")
    tok = train_bpe(
        [corpus],
        args.vocab_size,
        ["<|endoftext|>"],
        pattern=args.pattern,
        holdout=0.01,
        progress=True,
    )
    tok.save(target)
    print(format_report(tok.metadata["training"]))
    with gzip.open(embedded_corpus("valid"), "rt", encoding="utf-8") as handle:
        valid = handle.read()
    sample = inspect_text(tok, "sample", DEMO_SAMPLE)
    held = inspect_text(tok, "tinystories_valid", valid)
    print(f"validation split  {held.bytes_per_token:.3f} bytes/token ({held.n_tokens:,} tokens)")
    print("sample            " + render_terminal(sample.pieces, color=sys.stdout.isatty()))
    page = render_html([sample, held], longest_tokens(tok, 25), max_tokens=2000)
    write_html(out / "report" / "tokens.html", page)
    print(f"saved             {target}  (token view: {out / 'report' / 'tokens.html'})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kiln demo` to the CLI."""
    parser = sub.add_parser(
        "demo",
        help="run the main job on the embedded TinyStories corpus",
        description="Train a byte-level BPE tokenizer on the embedded TinyStories corpus, save it "
        "under runs/, and report its training summary and compression.",
        epilog="Example: kiln demo --vocab-size 4096 --out runs/demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--vocab-size", type=int, default=4096, help="tokens (default 4096)")
    parser.add_argument("--pattern", default="gpt2", help="split pattern (default gpt2)")
    parser.add_argument("--out", help="run folder (default runs/demo-<timestamp>)")
    parser.add_argument("--force", action="store_true", help="replace an existing tokenizer")
    parser.set_defaults(handler=run_demo)
