"""`kiln data run|tokenize|inspect|classifier|perplexity`: the data pipeline, plain tokenization,
inspection, and training the models of the model-based quality stages."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kiln.commands import add_command_group, add_subcommand, add_tokenizer_option
from kiln.data.procs import sigterm_as_interrupt
from kiln.errors import KilnError
from kiln.tokenizer.special import EOT

_EXAMPLES = {
    "run": """examples:
  kiln data run configs/pipeline_sample.toml
  kiln data run web.toml --out data/web --workers 16 --set dedup.near.bands=20
  kiln data run web.toml --executor ray --address auto     # on a Ray cluster
  kiln data run web.toml --force          # the config changed: rebuild (old output kept until done)
  kiln data run web.toml --memory-mb 512  # smaller dedup partitions (same output)""",
    "tokenize": """examples:
  kiln data tokenize --tokenizer tok.json stories.txt.gz --out data/stories
  kiln data tokenize --tokenizer tok.json web/*.jsonl.zst --text-field text --out data/web \\
      --val-docs 5000 --workers 16 --shard-tokens 100000000 --seed 1""",
    "classifier train": """examples:
  kiln data classifier train configs/quality_classifier.toml
  kiln data classifier train cls.toml --set epochs=10 --set output=cls10.npz""",
    "perplexity train": """examples:
  kiln data perplexity train configs/perplexity_lm.toml
  kiln data perplexity train lm.toml --set order=4""",
    "inspect": """examples:
  kiln data inspect data/stories
  kiln data inspect data/stories --tokenizer elsewhere/tok.json --split val --doc 3 --verify
  kiln data inspect data/web --token 123456789   # its document's history, removed neighbours
  kiln data inspect data/web --doc web:crawl/part-0001.jsonl:417   # the same, by document id""",
}


def register(sub: Any) -> None:
    """Add the `data` command group to the top-level `kiln` parser."""
    commands = add_command_group(
        sub,
        "data",
        "run the data pipeline, tokenize documents into shards, inspect datasets",
        "Data: the filter/dedup/decontaminate/mix pipeline, token-shard datasets, inspection.",
        "kiln data run configs/pipeline_sample.toml",
    )
    _add_run(commands)
    _add_tokenize(commands)
    _add_inspect(commands)
    _add_model_training(commands)


# ------------------------------------------------------------- classifier / perplexity train
def _add_model_training(commands: Any) -> None:
    for group, what, handler in (
        ("classifier", "the quality classifier (positive vs negative sources)", run_train_cls),
        ("perplexity", "the reference n-gram LM and its percentile cutoffs", run_train_lm),
    ):
        sub = add_command_group(
            commands,
            group,
            f"train {what} of the `{group}` pipeline stage",
            f"The model of the `quality.{group}` stage of `kiln data run`.",
            f"kiln data {group} train CONFIG.toml",
        )
        p = add_subcommand(sub, "train", f"train {what}", _EXAMPLES[f"{group} train"])
        p.add_argument("config", metavar="CONFIG.toml", help="the training config")
        p.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE", help="override a value"
        )
        p.set_defaults(handler=handler)


def run_train_cls(args: argparse.Namespace) -> int:
    """Handler of `kiln data classifier train`: train, write, print held-out accuracy."""
    from kiln.data.pipeline.filter.model_training import train_classifier

    record = train_classifier(args.config, tuple(args.set))
    held = record["held_out"]
    print(
        f"wrote {record['output']}: trained on {record['positive_documents']:,} positive and "
        f"{record['negative_documents']:,} negative documents; held-out accuracy "
        f"{held['accuracy']:.1%} on {held['documents']:,} (positive "
        f"{held['positive_accuracy']:.1%}, negative {held['negative_accuracy']:.1%})"
    )
    if "spearman" in held:  # trained on LM annotations: how its scores rank against theirs
        print(
            f"agreement with the annotations on the held-out documents: accuracy "
            f"{held['accuracy']:.1%} at score >= {record['positive_score']:g}, Spearman "
            f"{held['spearman']:.3f}"
        )
    return 0


def run_train_lm(args: argparse.Namespace) -> int:
    """Handler of `kiln data perplexity train`: train, write, print the cutoffs."""
    from kiln.data.pipeline.filter.model_training import train_perplexity_lm

    r = train_perplexity_lm(args.config, tuple(args.set))
    print(
        f"wrote {r['output']}: {r['order']}-gram LM on {r['tokens']:,} tokens "
        f"({r['vocab_size']:,} words); sample of {r['sample_documents']:,} documents: "
        f"30th percentile perplexity {r['p30']:.1f}, 60th {r['p60']:.1f}"
    )
    return 0


# ---------------------------------------------------------------------------------------- run
def _add_run(commands: Any) -> None:
    p = add_subcommand(
        commands,
        "run",
        "run a data pipeline (filter, dedup, decontaminate, mix, tokenize) from a TOML config",
        _EXAMPLES["run"],
    )
    p.add_argument("config", metavar="PIPELINE.toml", help="the pipeline config")
    p.add_argument("--out", help="the output dataset directory (default: `output` in the config)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes")
    p.add_argument("--executor", choices=("local", "ray"), default="local")
    p.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set quality.c4.enabled=false",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="rebuild although the output (or an unfinished run) has another config",
    )
    p.add_argument(
        "--memory-mb",
        type=int,
        default=2048,
        metavar="MB",
        help="memory per process for the dedup global pass: sets its number of partitions "
        "(the output does not depend on it; default 2048)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=run_pipeline_cmd)


def run_pipeline_cmd(args: argparse.Namespace) -> int:
    """Handler of `kiln data run`."""
    from kiln.data.pipeline.config import load_pipeline_config
    from kiln.data.pipeline.runner import RunOptions, run_pipeline
    from kiln.data.pipeline.summary import format_funnel

    if args.workers < 1:
        raise KilnError(f"--workers must be >= 1, got {args.workers}")
    if args.memory_mb < 1:
        raise KilnError(f"--memory-mb must be >= 1, got {args.memory_mb}")
    cfg = load_pipeline_config(args.config, tuple(args.set))
    opts = RunOptions(
        out=args.out or "",
        workers=args.workers,
        executor=args.executor,
        address=args.address,
        force=args.force,
        progress=not args.quiet,
        memory_mb=args.memory_mb,
    )
    with sigterm_as_interrupt():  # a killed run stops its workers; the next run resumes
        manifest = run_pipeline(cfg, opts)
    print(format_funnel(manifest))
    return 0


# ----------------------------------------------------------------------------------- tokenize
def _add_tokenize(commands: Any) -> None:
    p = add_subcommand(
        commands, "tokenize", "encode documents into a token-shard dataset", _EXAMPLES["tokenize"]
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help=".txt files (a document ends at a line holding only the end-of-text token; the "
        "token inside a line is text) or .jsonl files, maybe .gz/.zst/.bz2",
    )
    add_tokenizer_option(
        p,
        default=None,
        help_text="a kiln or HF tokenizer.json, GPT-2's vocab.json (merges.txt beside it), or "
        "'bytes': raw UTF-8 bytes, vocab 256 + end-of-text (saved into the dataset)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="dataset directory to create")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val-docs", type=int, metavar="N", help="exactly N val documents")
    val.add_argument(
        "--val-fraction", type=float, metavar="F", help="this fraction of documents (default 0.01)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the val sample (default 0)")
    p.add_argument(
        "--workers", type=int, metavar="N", help="encoding processes (default: all cores)"
    )
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=100_000_000,
        metavar="N",
        help="tokens per shard at most, unless one document is longer (default 100M)",
    )
    p.add_argument("--text-field", default="text", metavar="F", help="JSON field of .jsonl text")
    p.add_argument("--eot-token", default=EOT, metavar="T", help="the document separator token")
    p.add_argument("--force", action="store_true", help="replace an existing dataset at DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_tokenize)


def run_tokenize(args: argparse.Namespace) -> int:
    """Handler of `kiln data tokenize`."""
    from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards

    # TokenizeConfig checks these too, but by its field names; a user typed the flags.
    for flag, value, ok, expected in (
        ("--val-fraction", args.val_fraction, lambda v: 0 <= v < 1, "a fraction in [0, 1)"),
        ("--val-docs", args.val_docs, lambda v: v >= 0, ">= 0"),
        ("--shard-tokens", args.shard_tokens, lambda v: v >= 1, ">= 1"),
        ("--workers", args.workers, lambda v: v >= 1, ">= 1"),
    ):
        if value is not None and not ok(value):
            raise KilnError(f"{flag} {value}: expected {expected}")
    config = TokenizeConfig(
        tokenizer=args.tokenizer,
        inputs=tuple(args.inputs),
        out=args.out,
        val_docs=args.val_docs,
        val_fraction=args.val_fraction,
        seed=args.seed,
        shard_tokens=args.shard_tokens,
        text_field=args.text_field,
        eot_token=args.eot_token,
        workers=args.workers,
        force=args.force,
        progress=not args.quiet,
    )
    with sigterm_as_interrupt():  # stops the workers and removes the unfinished dataset
        manifest = tokenize_to_shards(config)
    for src in manifest.sources:
        if src.invalid_utf8_documents:
            print(
                f"warning: {src.path}: invalid UTF-8 in {src.invalid_utf8_documents} document(s) "
                f"replaced with U+FFFD (first at {src.invalid_utf8_first})",
                file=sys.stderr,
            )
        if src.inline_separators:
            print(
                f"note: {src.path}: {src.inline_separators} {config.eot_token} inside documents "
                "(not on a line of their own) kept as ordinary text",
                file=sys.stderr,
            )
    for name, split in manifest.splits.items():
        print(
            f"{name}: {split.tokens:,} tokens, {split.documents:,} documents, "
            f"{len(split.shards)} shard(s)"
        )
    print(f"wrote {args.out}")
    return 0


# ------------------------------------------------------------------------------------ inspect
def _add_inspect(commands: Any) -> None:
    p = add_subcommand(
        commands,
        "inspect",
        "summarise a token-shard dataset and show a document",
        _EXAMPLES["inspect"],
    )
    p.add_argument("directory", metavar="DIR", help="a dataset made by `kiln data tokenize`")
    add_tokenizer_option(
        p, default="the one the manifest names", help_text="tokenizer to decode with"
    )
    p.add_argument("--split", default="train", help="split of the sample document (default train)")
    p.add_argument(
        "--doc",
        default="0",
        metavar="N|ID",
        help="the document to show: an index in --split, or a document id (datasets made by "
        "`kiln data run`: prints its history; prefix `id:` for an id made of digits)",
    )
    p.add_argument("--max-chars", type=int, default=600, help="show at most this much of it")
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="check every file's sha256 (default: on first use, unless KILN_VERIFY_SHARDS=0; "
        "--verify hashes files stamped as checked too)",
    )
    p.add_argument(
        "--token",
        type=int,
        metavar="POS",
        help="show the document holding token POS of --split with its history (source record, "
        "changes, merged duplicates) and the removed documents near it in the input (datasets "
        "made by `kiln data run`)",
    )
    p.set_defaults(handler=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    """Handler of `kiln data inspect`."""
    from kiln.data.shard_reader import Dataset

    ds = Dataset.open(args.directory, tokenizer=args.tokenizer, verify=args.verify)
    m = ds.manifest
    print(
        f"dataset {ds.root}: {m.dtype} tokens, vocab {m.tokenizer.vocab_size}, "
        f"end-of-text {m.tokenizer.eot_token!r} = {m.tokenizer.eot_id}"
    )
    print(f"tokenizer {m.tokenizer.path} (sha256 {m.tokenizer.sha256[:12]}…)")
    for name, split in ds.splits.items():
        print(
            f"  {name:<6} {split.n_tokens:>14,} tokens {split.n_documents:>10,} documents "
            f"{len(split.shards):>4} shard(s)"
        )
    print("sources:")
    for src in m.sources:
        per_split = ", ".join(
            f"{s} {src.tokens.get(s, 0):,} tokens / {src.documents.get(s, 0):,} docs"
            for s in ds.splits
        )
        dropped = f"; skipped {src.empty_skipped} empty" if src.empty_skipped else ""
        repaired = (
            f"; {src.invalid_utf8_documents} with invalid UTF-8 replaced"
            if src.invalid_utf8_documents
            else ""
        )
        inline = (
            f"; {src.inline_separators} {m.tokenizer.eot_token} inside documents kept as text"
            if src.inline_separators
            else ""
        )
        print(f"  {src.path}: {per_split}{dropped}{repaired}{inline}")
    if args.token is not None:
        from kiln.data.pipeline.audit import explain_token

        print(explain_token(ds, args.split, args.token))
        return 0
    doc = args.doc.removeprefix("id:")
    if doc.isdigit() and not args.doc.startswith("id:"):
        from kiln.data.pipeline.audit import explain_index

        args.doc = int(doc)
        history = explain_index(ds, args.split, args.doc)
        if history is not None:  # a dataset made by `kiln data run`
            print(history)
    else:
        from kiln.data.pipeline.audit import explain_document, find_document

        print(explain_document(ds.root, doc))
        args.split, _, _, args.doc = find_document(ds.root, doc)
    _print_sample(ds, args)
    return 0


def _print_sample(ds: Any, args: argparse.Namespace) -> None:
    split = ds.split(args.split)
    if not 0 <= args.doc < split.n_documents:
        raise KilnError(f"--doc {args.doc}: split {args.split!r} has {split.n_documents} documents")
    tok_path = args.tokenizer or ds.manifest.tokenizer.path
    if not os.path.isfile(tok_path):
        print(f"sample: tokenizer {tok_path} not found; pass --tokenizer to decode a document")
        return
    from kiln.tokenizer.formats import read_any

    if args.tokenizer is None:
        # The stored path may now hold a different file; decoding with it would mislead.
        from kiln.io import sha256_file

        if sha256_file(tok_path) != ds.manifest.tokenizer.sha256:
            raise KilnError(
                f"{tok_path}: changed since the dataset was encoded (sha256 differs); pass "
                "--tokenizer with the original file"
            )
    tokens = split.document(args.doc)
    split.check_ids(tokens, split.document_start(args.doc), ds.vocab_size)
    text, marked = render_special_tokens(read_any(tok_path), tokens.tolist())
    shown = text if len(text) <= args.max_chars else text[: args.max_chars] + "…"
    print(
        f"sample: {args.split} document {args.doc} ({len(tokens)} tokens, from "
        f"{split.document_source(args.doc)}):"
    )
    print(shown)
    if marked:
        print(f"({SPECIAL_MARK[0]}…{SPECIAL_MARK[1]} marks a real special token; the same text "
              "without the marks is ordinary text inside the document)")  # fmt: skip


SPECIAL_MARK = ("⟦", "⟧")


def render_special_tokens(tokenizer: Any, ids: list[int]) -> tuple[str, bool]:
    """The decoded text with each real special token shown as ⟦token⟧; and whether any was."""
    by_id = {i: s for s, i in tokenizer.special_tokens.items()}
    pieces: list[str] = []
    run: list[int] = []
    for i in ids:
        if i in by_id:
            pieces += [tokenizer.decode(run), f"{SPECIAL_MARK[0]}{by_id[i]}{SPECIAL_MARK[1]}"]
            run = []
        else:
            run.append(i)
    pieces.append(tokenizer.decode(run))
    return "".join(pieces), len(pieces) > 1
