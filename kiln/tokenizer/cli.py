"""`kiln tokenizer train|encode|decode|inspect|convert`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from kiln.commands import add_command_group, add_subcommand, add_tokenizer_option
from kiln.errors import KilnError
from kiln.io import check_can_write, open_binary
from kiln.tokenizer.special import CHAT_TOKENS, EOT
from kiln.tokenizer.tokenizer import BYTES, Tokenizer

DEFAULT_SPECIAL = EOT


_EXAMPLES = {
    "train": """examples:
  kiln tokenizer train corpus.txt --vocab-size 8000 -o tok.json
  kiln tokenizer train corpus.txt --vocab-size 8000 --chat -o chat-tok.json
  kiln tokenizer train data/*.jsonl.gz --text-field text --vocab-size 32000 --workers 8 \\
      --pattern cl100k -o tok.json --resume""",
    "encode": """examples:
  kiln tokenizer encode --tokenizer tok.json "Hello world"
  kiln tokenizer encode --tokenizer gpt2:vocab.json:merges.txt -f story.txt --json""",
    "decode": """examples:
  kiln tokenizer decode --tokenizer tok.json 15496 995
  kiln tokenizer encode --tokenizer tok.json "hi" | kiln tokenizer decode --tokenizer tok.json""",
    "inspect": """examples:
  kiln tokenizer inspect --tokenizer tok.json "Tokenizers split text into pieces."
  kiln tokenizer inspect --tokenizer tok.json -f a.txt -f b.txt --html view.html --top 20""",
    "convert": """examples:
  kiln tokenizer convert tok.json tok-hf.json --to hf
  kiln tokenizer convert tok.json tok.tiktoken
  kiln tokenizer convert vocab.json gpt2.json --from gpt2 --merges merges.txt""",
}


def register(sub: Any) -> None:
    """Add the `tokenizer` command group to the top-level `kiln` parser."""
    commands = add_command_group(
        sub,
        "tokenizer",
        "train, use, inspect and convert byte-level BPE tokenizers",
        "Byte-level BPE tokenizers: train, encode, decode, inspect, convert.",
        "kiln tokenizer train corpus.txt --vocab-size 8000 -o tok.json",
    )
    _add_train(commands)
    _add_encode(commands)
    _add_decode(commands)
    _add_inspect(commands)
    _add_convert(commands)


# ------------------------------------------------------------------------------------ loading
def load_tokenizer(spec: str) -> Any:
    """A tokenizer from `--tokenizer`: a kiln or HF tokenizer.json, `gpt2:VOCAB:MERGES`, `bytes`."""
    from kiln.tokenizer.formats import read_any, read_gpt2

    if spec.startswith("gpt2:"):
        parts = spec.split(":", 2)
        if len(parts) != 3 or not all(parts[1:]):
            raise KilnError(f"--tokenizer {spec!r}: expected gpt2:VOCAB_JSON:MERGES_TXT")
        return read_gpt2(parts[1], parts[2])
    if spec == BYTES:
        return Tokenizer.raw_bytes()
    if spec == "gpt2":
        raise KilnError("--tokenizer gpt2: give GPT-2's files as gpt2:VOCAB_JSON:MERGES_TXT")
    return read_any(spec)


def _read_input_file(path: str) -> str:
    """A text file's content (`.gz`/`.zst`/`.bz2` decompressed); invalid UTF-8 is an error."""
    with open_binary(path) as handle:
        data = handle.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KilnError(f"{path}: invalid UTF-8 at byte offset {exc.start}") from None


# -------------------------------------------------------------------------------------- train
def _add_train(commands: Any) -> None:
    p = add_subcommand(
        commands, "train", "train a byte-level BPE tokenizer on text files", _EXAMPLES["train"]
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help=".txt/.jsonl files (maybe .gz/.zst) or directories of them",
    )
    p.add_argument("--vocab-size", type=int, required=True, help="final vocab size incl. specials")
    p.add_argument("-o", "--output", required=True, metavar="OUT.json", help="tokenizer file")
    p.add_argument(
        "--special-token",
        action="append",
        metavar="T",
        help=f"a special token (repeatable; default {DEFAULT_SPECIAL})",
    )
    p.add_argument("--no-special-tokens", action="store_true", help="train without special tokens")
    p.add_argument(
        "--chat",
        action="store_true",
        help=f"also reserve the chat format's tokens ({', '.join(CHAT_TOKENS)})",
    )
    p.add_argument(
        "--pattern", default="gpt2", help="gpt2, cl100k, o200k or a regex (default gpt2)"
    )
    p.add_argument("--workers", type=int, default=None, help="counting processes (default: CPUs)")
    p.add_argument("--min-frequency", type=int, default=1, help="drop rarer pre-tokens (default 1)")
    p.add_argument(
        "--text-field", default="text", help="JSON field of .jsonl inputs (default text)"
    )
    p.add_argument("--invalid-utf8", choices=("replace", "error"), default="replace")
    p.add_argument(
        "--holdout", type=float, default=0.01, help="fraction held out to measure compression"
    )
    p.add_argument("--resume", action="store_true", help="continue from OUT.json.train-state")
    p.add_argument("--force", action="store_true", help="replace OUT.json if it exists")
    p.set_defaults(handler=run_train)


def run_train(args: argparse.Namespace) -> int:
    """Train, save the tokenizer and print the training report."""
    from kiln.tokenizer import train as train_module

    check_can_write(args.output, args.force)
    if args.no_special_tokens and args.special_token:
        raise KilnError("--no-special-tokens and --special-token contradict each other")
    if args.no_special_tokens and args.chat:
        raise KilnError("--no-special-tokens and --chat contradict each other")
    specials = [] if args.no_special_tokens else (args.special_token or [DEFAULT_SPECIAL])
    if args.chat:
        specials += [t for t in CHAT_TOKENS if t not in specials]
    tok = train_module.train_bpe(
        train_module.iter_files(args.inputs),
        args.vocab_size,
        special_tokens=specials,
        pattern=args.pattern,
        workers=args.workers,
        min_frequency=args.min_frequency,
        text_field=args.text_field,
        invalid_utf8=args.invalid_utf8,
        holdout=args.holdout,
        checkpoint_dir=args.output + ".train-state",
        resume=args.resume,
        progress=True,
    )
    tok.save(args.output, force=args.force)
    print(train_module.format_report(tok.metadata["training"]))
    print(f"wrote {args.output}")
    return 0


# ----------------------------------------------------------------------------- encode / decode
def _add_encode(commands: Any) -> None:
    p = add_subcommand(commands, "encode", "encode text to token ids", _EXAMPLES["encode"])
    add_tokenizer_option(p, default=None)
    p.add_argument("text", nargs="?", metavar="TEXT", help="text to encode (default: stdin)")
    p.add_argument("-f", "--file", help="encode this file's content instead")
    p.add_argument(
        "--allow-special",
        action="store_true",
        help="encode special-token text as the special token (otherwise it is an error)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(handler=run_encode)


def _input_text(args: argparse.Namespace) -> str:
    if args.text is not None and args.file:
        raise KilnError("give TEXT or -f FILE, not both")
    if args.file:
        return _read_input_file(args.file)
    return args.text if args.text is not None else sys.stdin.read()


def run_encode(args: argparse.Namespace) -> int:
    """Print the ids of the text, space-separated or as JSON."""
    tok = load_tokenizer(args.tokenizer)
    text = _input_text(args)
    try:
        ids = tok.encode(text, allowed_special="all" if args.allow_special else frozenset())
    except ValueError as exc:
        raise KilnError(f"{exc} (on the command line: --allow-special)") from None
    print(json.dumps(ids) if args.json else " ".join(map(str, ids)))
    return 0


def _add_decode(commands: Any) -> None:
    p = add_subcommand(commands, "decode", "decode token ids to text", _EXAMPLES["decode"])
    add_tokenizer_option(p, default=None)
    p.add_argument("ids", nargs="*", metavar="ID", help="token ids (default: read from stdin)")
    p.set_defaults(handler=run_decode)


def parse_ids(words: Sequence[str]) -> list[int]:
    """Token ids from words such as `1 2 3`, `1,2,3` or a JSON list `[1, 2, 3]`."""
    ids = []
    for word in " ".join(words).replace(",", " ").replace("[", " ").replace("]", " ").split():
        if not (word.isascii() and word.isdigit()):
            raise KilnError(f"{word!r} is not a token id (a non-negative integer)")
        ids.append(int(word))
    return ids


def run_decode(args: argparse.Namespace) -> int:
    """Print the text the ids stand for."""
    tok = load_tokenizer(args.tokenizer)
    ids = parse_ids(args.ids if args.ids else [sys.stdin.read()])
    try:
        print(tok.decode(ids))
    except (ValueError, OverflowError) as exc:
        raise KilnError(str(exc)) from None
    return 0


# ------------------------------------------------------------------------------------ inspect
def _add_inspect(commands: Any) -> None:
    p = add_subcommand(
        commands,
        "inspect",
        "show how text splits into tokens, compression, longest",
        _EXAMPLES["inspect"],
    )
    add_tokenizer_option(p, default=None)
    p.add_argument("text", nargs="?", metavar="TEXT", help="text to inspect")
    p.add_argument("-f", "--file", action="append", default=[], help="a file to inspect (repeat)")
    p.add_argument("--html", metavar="OUT", help="also write an HTML view to OUT")
    p.add_argument("--top", type=int, default=10, metavar="N", help="show the N longest tokens")
    p.add_argument(
        "--max-tokens", type=int, default=2000, metavar="N", help="tokens shown per input"
    )
    p.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour token boundaries (auto: when printing to a terminal)",
    )
    p.set_defaults(handler=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    """Print each input's tokens, the compression table and the longest tokens."""
    from kiln.tokenizer import inspect as view

    tok = load_tokenizer(args.tokenizer)
    inputs = [(path, _read_input_file(path)) for path in args.file]
    if args.text is not None:
        inputs.insert(0, ("<text>", args.text))
    if not inputs:
        inputs.append(("<stdin>", sys.stdin.read()))
    inspections = [view.inspect_text(tok, name, text) for name, text in inputs]
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    for i in inspections:
        print(f"== {i.name}")
        print(view.render_terminal(i.pieces[: args.max_tokens], color=color))
        if i.n_tokens > args.max_tokens:
            print(f"... ({i.n_tokens - args.max_tokens:,} more tokens)")
    print()
    print(view.format_summary(inspections))
    longest = view.longest_tokens(tok, args.top)
    if longest:
        print()
        print(f"{len(longest)} longest tokens")
        print(view.format_longest(longest))
    if args.html:
        page = view.render_html(inspections, longest, max_tokens=args.max_tokens)
        view.write_html(args.html, page)
        print(f"wrote {args.html}")
    return 0


# ------------------------------------------------------------------------------------ convert
def _add_convert(commands: Any) -> None:
    formats = ("kiln", "hf", "gpt2", "tiktoken")
    p = add_subcommand(
        commands,
        "convert",
        "convert between kiln, HF, GPT-2 and tiktoken files",
        _EXAMPLES["convert"],
    )
    p.add_argument("src", metavar="SRC", help="input file (a GPT-2 vocab.json for --from gpt2)")
    p.add_argument("dst", metavar="DST", help="output file")
    p.add_argument("--from", dest="src_format", choices=formats, help="default: from the content")
    p.add_argument(
        "--to", dest="dst_format", choices=("kiln", "hf", "tiktoken"), help="default: from DST"
    )
    p.add_argument("--merges", help="GPT-2 merges.txt (default: merges.txt beside SRC)")
    p.add_argument("--pattern", default="gpt2", help="split pattern of a tiktoken input")
    p.add_argument(
        "--special-token",
        action="append",
        default=[],
        metavar="NAME=ID",
        help="a special token of a tiktoken input (repeatable)",
    )
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.set_defaults(handler=run_convert)


def parse_special_ids(items: Sequence[str]) -> dict[str, int] | None:
    """`NAME=ID` pairs as a dict (None when none are given)."""
    if not items:
        return None
    out = {}
    for item in items:
        name, sep, number = item.rpartition("=")
        if not sep or not name or not number.isdigit():
            raise KilnError(f"--special-token {item!r}: expected NAME=ID, e.g. '{EOT}=100'")
        out[name] = int(number)
    return out


def run_convert(args: argparse.Namespace) -> int:
    """Read SRC in one format and write DST in another."""
    from kiln.tokenizer.formats import convert

    tok, src_format, dst_format = convert(
        args.src,
        args.dst,
        src_format=args.src_format,
        dst_format=args.dst_format,
        force=args.force,
        merges=args.merges,
        pattern=args.pattern,
        special_tokens=parse_special_ids(args.special_token),
    )
    print(f"read {args.src} ({src_format}), wrote {os.fspath(args.dst)} ({dst_format}): {tok!r}")
    return 0
