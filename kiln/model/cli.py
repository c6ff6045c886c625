"""`kiln sample`: generate text from a model directory, streaming tokens as they are decoded."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from kiln.errors import KilnError


class TextCodec(Protocol):
    """What sampling needs from a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Token ids of text."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids."""
        ...


EXAMPLES = """examples:
  kiln sample runs/hf-gpt2 --prompt 'Once upon a time' --max-tokens 100 --temperature 0.8 \\
      --top-k 50 --seed 0"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kiln sample` to the `kiln` command."""
    from kiln.commands import add_subcommand

    p = add_subcommand(
        sub,
        "sample",
        "generate text from a model directory (Hugging Face format: config.json + safetensors)",
        EXAMPLES,
        description="Generate text from a model, printing tokens as they are decoded.",
    )
    p.add_argument("model", help="model directory with config.json and model.safetensors")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 50256,464")
    p.add_argument(
        "--tokenizer",
        help="kiln tokenizer.json, HF tokenizer.json, or a directory with GPT-2's vocab.json + "
        "merges.txt (default: looked for in the model directory)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass, e.g. 0.95")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible samples")
    p.add_argument(
        "--stop-id",
        type=int,
        action="append",
        default=None,
        help="token id that ends the sample (repeatable; default: the model's eos_token_id)",
    )
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.set_defaults(handler=run_sample)


def run_sample(args: argparse.Namespace) -> int:
    """Load the model (and tokenizer), then stream the sample to stdout."""
    from kiln.model.generate import stream
    from kiln.model.hf import load_hf_dir

    model_dir = Path(args.model)
    model = load_hf_dir(model_dir, device=args.device).eval()
    codec = None
    if args.prompt is not None or args.tokenizer is not None:
        codec = load_codec(Path(args.tokenizer) if args.tokenizer else model_dir)
    if codec is not None and args.prompt is not None:
        ids = codec.encode(args.prompt)
    else:
        ids = _parse_ids(args.prompt_ids)
    stop = args.stop_id if args.stop_id is not None else eos_ids(model_dir)
    tokens = stream(
        model, ids, args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, stop_tokens=stop,
    )  # fmt: skip
    if codec is None:
        for token in tokens:
            print(token, end=" ", flush=True)
        print()
    else:
        _print_text(codec, ids, tokens)
    return 0


def _print_text(codec: TextCodec, prompt: list[int], tokens: Any) -> None:
    """Print the prompt then each new piece of text as soon as it decodes to whole characters."""
    sys.stdout.write(codec.decode(prompt))
    new: list[int] = []
    shown = ""
    for token in tokens:
        new.append(token)
        text = codec.decode(new)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
    sys.stdout.write(codec.decode(new)[len(shown) :] + "\n")


def _parse_ids(text: str) -> list[int]:
    """Comma-separated token ids, with a clear error for anything else."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise KilnError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise KilnError("--prompt-ids is empty")
    return ids


def eos_ids(model_dir: Path) -> list[int]:
    """The end-of-sequence id(s) named in the model's config.json, if any."""
    eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]


def tokenizer_file_in(model_dir: Path) -> Path:
    """The tokenizer file of a model directory: tokenizer.json, or GPT-2's vocab.json."""
    for name in ("tokenizer.json", "vocab.json"):
        if (model_dir / name).is_file():
            return model_dir / name
    raise KilnError(f"{model_dir}: no tokenizer.json or vocab.json; pass --tokenizer")


def load_codec(path: Path) -> TextCodec:
    """A tokenizer from a file (kiln, HF or GPT-2 format) or a directory holding one."""
    if path.is_dir():
        path = tokenizer_file_in(path)
    from kiln.tokenizer.formats import read_any  # kiln, HF tokenizer.json, GPT-2 vocab.json

    return _KilnCodec(read_any(path))


class _KilnCodec:
    """kiln's Tokenizer; special-token text in a prompt is allowed (e.g. <|endoftext|>)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        """Token ids of text."""
        return list(self.tok.encode(text, allowed_special="all"))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids."""
        return str(self.tok.decode(list(ids)))
