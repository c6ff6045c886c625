"""Benchmark kiln's byte-level BPE tokenizer side by side with rustbpe, tiktoken, HF and SentencePiece.

Three parts, one run, ratios kiln/peer against the targets of issue 2:
1. training wall time and peak memory (vocab 10K and 32K on the 100 MB English corpus), each
   trainer in its own subprocess, the time including reading and decompressing the .gz;
2. encoding throughput (MB/s of UTF-8 input) with the GPT-2 vocabulary, kiln vs tiktoken (and HF
   tokenizers), one thread and two, on English and multilingual text, checking identical ids;
3. decoding throughput, kiln vs tiktoken.

    python bench/tokenizer.py                 # the full measurement (several minutes)
    python bench/tokenizer.py --quick         # smoke test: train on en_10m, 1 repeat (< 1 min)
    python bench/tokenizer.py --results bench/RESULTS.md   # also write the `## Tokenizer` section
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# Run as a script from a plain checkout too.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._load import add_noisy_flag, begin  # noqa: E402
from kiln.io import atomic_write  # noqa: E402

DATA = REPO.parent / "shared" / "data"
BENCH_DATA = DATA / "bench"
GPT2_DIR = DATA / "gpt2"
EOT = "<|endoftext|>"
DOC_SEP = f"\n{EOT}\n"
TRAINERS = ("kiln", "rustbpe", "hf", "sentencepiece")
SCRATCH = Path(tempfile.gettempdir()) / "kiln_bench_tokenizer"
SP_LIMIT_S = 180.0  # SentencePiece on the 100 MB corpus: fall back to en_10m beyond this


# ------------------------------------------------------------------------------------- corpus
def iter_docs(path: Path, chunk_chars: int = 1 << 20) -> Iterator[str]:
    """Stream the documents of a .gz corpus (separated by a `<|endoftext|>` line)."""
    with gzip.open(path, "rt", encoding="utf-8", newline="") as handle:
        buf = ""
        while chunk := handle.read(chunk_chars):
            parts = (buf + chunk).split(DOC_SEP)
            buf = parts.pop()
            yield from parts
        if buf:
            yield buf


def read_text(path: Path) -> str:
    """The whole decompressed corpus as one string (separators included)."""
    with gzip.open(path, "rt", encoding="utf-8", newline="") as handle:
        return handle.read()


def plain_text_for_sentencepiece(path: Path) -> Path:
    """Write the corpus as plain text lines (separators dropped) for SentencePiece, once."""
    SCRATCH.mkdir(parents=True, exist_ok=True)
    out = SCRATCH / (path.name.removesuffix(".gz"))
    if not out.exists():
        tmp = out.with_suffix(".part")
        with open(tmp, "w", encoding="utf-8", newline="") as handle:
            for doc in iter_docs(path):
                handle.write(doc)
                handle.write("\n")
        tmp.rename(out)
    return out


# ------------------------------------------------------------------------------------ workers
def train_kiln(corpus: Path, vocab: int, workdir: Path) -> dict[str, Any]:
    """kiln's trainer reads the .gz itself (GPT-2 pattern, 2 workers)."""
    from kiln.tokenizer import train_bpe

    tok = train_bpe([corpus], vocab, [EOT], pattern="gpt2", workers=2)
    return {"vocab": tok.n_vocab, "merges": len(tok.merges), "pattern": "GPT-2 regex"}


def train_rustbpe(corpus: Path, vocab: int, workdir: Path) -> dict[str, Any]:
    """rustbpe on an iterator of documents; vocab - 1 so it learns as many merges as kiln."""
    import rustbpe

    from kiln.tokenizer.patterns import GPT2_PATTERN

    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(iter_docs(corpus), vocab - 1, pattern=GPT2_PATTERN)
    return {"vocab": tok.vocab_size, "merges": tok.vocab_size - 256, "pattern": "GPT-2 regex"}


def train_hf(corpus: Path, vocab: int, workdir: Path) -> dict[str, Any]:
    """HF tokenizers BPE with the ByteLevel pre-tokenizer (its regex is GPT-2's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_docs(corpus), trainer)
    n = tok.get_vocab_size()
    return {"vocab": n, "merges": n - 257, "pattern": "GPT-2 regex (ByteLevel)"}


def train_sentencepiece(corpus: Path, vocab: int, workdir: Path) -> dict[str, Any]:
    """SentencePiece BPE with byte fallback on a plain text file (its own whitespace splitting)."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(workdir / f"sp_{vocab}"),
        vocab_size=vocab,
        model_type="bpe",
        byte_fallback=True,
        num_threads=2,
        input_sentence_size=0,
        train_extremely_large_corpus=True,
        minloglevel=2,
    )
    return {"vocab": vocab, "pattern": "none (SentencePiece whitespace pieces)"}


TRAIN_FUNCS: dict[str, Callable[[Path, int, Path], dict[str, Any]]] = {
    "kiln": train_kiln,
    "rustbpe": train_rustbpe,
    "hf": train_hf,
    "sentencepiece": train_sentencepiece,
}


def worker_main(impl: str, corpus: Path, vocab: int, workdir: Path) -> None:
    """Child process: train once, print a JSON line with time and peak memory."""
    t0 = time.perf_counter()
    info = TRAIN_FUNCS[impl](corpus, vocab, workdir)
    seconds = time.perf_counter() - t0
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
    print(json.dumps({"seconds": seconds, "maxrss_mb": own, "children_maxrss_mb": kids, **info}))


def run_trainer(
    impl: str, corpus: Path, vocab: int, timeout: float | None = None
) -> dict[str, Any]:
    """Run one trainer in its own subprocess; poll the process tree's RSS for the peak."""
    import psutil

    SCRATCH.mkdir(parents=True, exist_ok=True)
    log = SCRATCH / f"train_{impl}_{vocab}_{corpus.name}.log"
    cmd = [sys.executable, __file__, "--worker", "train", "--impl", impl]
    cmd += ["--vocab", str(vocab), "--corpus", str(corpus)]
    t0 = time.perf_counter()
    with open(log, "w") as err:
        proc = psutil.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        peak = 0
        while proc.poll() is None:
            try:
                procs = [proc, *proc.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass
            if timeout is not None and time.perf_counter() - t0 > timeout:
                for p in proc.children(recursive=True):
                    p.kill()
                proc.kill()
                proc.wait()
                return {"impl": impl, "vocab": vocab, "timed_out": True, "limit_s": timeout}
            time.sleep(0.02)
        out = proc.stdout.read() if proc.stdout else ""
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} trainer failed (rc {proc.returncode}); see {log}")
    res = json.loads(out.strip().splitlines()[-1])
    peak_mb = max(peak / 2**20, res["maxrss_mb"], res["children_maxrss_mb"])
    return {"impl": impl, "corpus": corpus.name, "wall_s": wall, "peak_mb": peak_mb, **res}


# ---------------------------------------------------------------------------------- measuring
def best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Best wall time of `repeats` calls and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def mbps(nbytes: int, seconds: float) -> float:
    """Throughput in MB/s (10^6 bytes)."""
    return nbytes / seconds / 1e6


def machine_info() -> dict[str, str]:
    """nproc, CPU model, memory, date, Python and library versions."""
    cpu = "?"
    with open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import psutil

    import kiln

    versions = {"kiln": kiln.__version__}
    for pkg in ("tiktoken", "rustbpe", "tokenizers", "sentencepiece"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = "missing"
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "memory": f"{psutil.virtual_memory().total / 2**30:.0f} GiB",
        "python": platform.python_version(),
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items()),
    }


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- training
def bench_training(corpus: Path, fallback: Path, vocabs: Sequence[int], kiln_runs: int) -> dict:
    """Train every implementation at every vocab size; returns rows and the kiln/rustbpe ratios."""
    results: dict[tuple[str, int], dict[str, Any]] = {}
    notes: list[str] = []
    sp_corpus = plain_text_for_sentencepiece(corpus)
    sp_fallback = False
    for vocab in vocabs:
        for impl in TRAINERS:
            if impl == "sentencepiece":
                path = plain_text_for_sentencepiece(fallback) if sp_fallback else sp_corpus
                res = run_trainer(impl, path, vocab, timeout=None if sp_fallback else SP_LIMIT_S)
                if res.get("timed_out"):
                    notes.append(
                        f"SentencePiece exceeded {SP_LIMIT_S:.0f} s on {corpus.name} at vocab "
                        f"{vocab}; it was run on {fallback.name} instead (not comparable)."
                    )
                    sp_fallback = True
                    path = plain_text_for_sentencepiece(fallback)
                    res = run_trainer(impl, path, vocab)
            else:
                runs = [
                    run_trainer(impl, corpus, vocab)
                    for _ in range(kiln_runs if impl == "kiln" else 1)
                ]
                res = min(runs, key=lambda r: r["seconds"])
                res["runs_s"] = [round(r["seconds"], 1) for r in runs]
                res["peak_mb"] = max(r["peak_mb"] for r in runs)
            results[(impl, vocab)] = res
            print(
                f"  train {impl:13s} vocab {vocab:6d} on {res['corpus']}: {res['seconds']:6.1f} s, "
                f"peak {res['peak_mb']:7.0f} MiB",
                flush=True,
            )
    rows = []
    for vocab in vocabs:
        ref = results[("rustbpe", vocab)]
        for impl in TRAINERS:
            r = results[(impl, vocab)]
            secs = f"{r['seconds']:.1f}"
            if len(r.get("runs_s", [])) > 1:
                secs += f" (runs: {', '.join(map(str, r['runs_s']))})"
            rows.append(
                [
                    f"{vocab // 1000}K",
                    impl,
                    r["corpus"],
                    secs,
                    f"{r['seconds'] / ref['seconds']:.2f}",
                    f"{r['peak_mb']:.0f}",
                    f"{r['peak_mb'] / ref['peak_mb']:.2f}",
                    r.get("merges", "—"),
                    r["pattern"],
                ]
            )
    header = [
        "vocab",
        "trainer",
        "corpus",
        "time s",
        "× rustbpe",
        "peak MiB",
        "× rustbpe",
        "merges",
        "split",
    ]
    return {"results": results, "table": table(header, rows), "notes": notes}


# ----------------------------------------------------------------------------------- encoding
def gpt2_tokenizers() -> tuple[Any, Any, Any]:
    """kiln, tiktoken and HF tokenizers built offline from GPT-2's vocab.json + merges.txt."""
    import tiktoken

    from kiln.tokenizer import Tokenizer
    from kiln.tokenizer.formats import write_hf
    from kiln.tokenizer.patterns import GPT2_PATTERN

    tok = Tokenizer.from_gpt2(GPT2_DIR / "vocab.json", GPT2_DIR / "merges.txt")
    ranks = {b: i for i, b in tok.vocab.items() if i != 50256}
    enc = tiktoken.Encoding(
        name="gpt2-offline",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={EOT: 50256},
    )
    hf = None
    try:
        import tokenizers

        SCRATCH.mkdir(parents=True, exist_ok=True)
        path = SCRATCH / "gpt2_hf.json"
        write_hf(tok, path, force=True)
        hf = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # optional peer
        print(f"  (HF tokenizers skipped: {exc})")
    return tok, enc, hf


def bench_encoding(corpora: Sequence[Path], repeats: int, with_hf: bool) -> dict[str, Any]:
    """Encode/decode throughput, kiln vs tiktoken (and HF) on the GPT-2 vocabulary."""
    tok, enc, hf = gpt2_tokenizers()
    hf = hf if with_hf else None
    rows, ratios, mismatches = [], {}, []
    decode_rows: Any = []
    for path in corpora:
        text = read_text(path)
        docs = text.split(DOC_SEP)
        whole_bytes = len(text.encode("utf-8"))
        docs_bytes = sum(len(d.encode("utf-8")) for d in docs)
        cases: list[tuple[str, int, dict[str, Callable[[], Any]]]] = [
            (
                "1 thread, whole text",
                whole_bytes,
                {
                    "kiln": lambda text=text: tok.encode_ordinary(text),
                    "tiktoken": lambda text=text: enc.encode_ordinary(text),
                },
            ),
            (
                "1 thread, loop over docs",
                docs_bytes,
                {
                    "kiln": lambda docs=docs: [tok.encode_ordinary(d) for d in docs],
                    "tiktoken": lambda docs=docs: [enc.encode_ordinary(d) for d in docs],
                    "hf": lambda docs=docs: [
                        hf.encode(d, add_special_tokens=False).ids for d in docs
                    ],
                },
            ),
            (
                "2 threads, batch of docs",
                docs_bytes,
                {
                    "kiln": lambda docs=docs: tok.encode_batch(docs, workers=2),
                    "tiktoken": lambda docs=docs: enc.encode_ordinary_batch(docs, num_threads=2),
                    "hf": lambda docs=docs: [
                        e.ids for e in hf.encode_batch(docs, add_special_tokens=False)
                    ],
                },
            ),
        ]
        whole_ids: list[int] = []
        for label, nbytes, impls in cases:
            speeds, outputs = {}, {}
            for name, fn in impls.items():
                if name == "hf" and hf is None:
                    continue
                secs, out = best_of(fn, repeats)
                speeds[name], outputs[name] = mbps(nbytes, secs), out
            for name, out in outputs.items():
                if name != "kiln" and out != outputs["kiln"]:
                    mismatches.append(f"{path.name}, {label}: kiln ids differ from {name}'s")
            if label.endswith("whole text"):
                whole_ids = outputs["kiln"]
            ratio = speeds["kiln"] / speeds["tiktoken"]
            ratios[(path.name, label)] = ratio
            rows.append(
                [
                    path.name,
                    label,
                    f"{speeds['kiln']:.1f}",
                    f"{speeds['tiktoken']:.1f}",
                    f"**{ratio:.2f}**",
                    f"{speeds['hf']:.1f}" if "hf" in speeds else "—",
                    "yes" if all(o == outputs["kiln"] for o in outputs.values()) else "**NO**",
                ]
            )
            print(f"  encode {path.name} {label}: kiln/tiktoken {ratio:.2f}", flush=True)
        if not decode_rows:  # decoding on the first (English) corpus's ids
            decode_rows = bench_decoding(tok, enc, whole_ids, text, path.name, repeats)
            for label, ratio, same in decode_rows[1]:
                ratios[(path.name, label)] = ratio
                if not same:
                    mismatches.append(f"{path.name}: kiln {label} output differs from tiktoken's")
            decode_rows = decode_rows[0]
    enc_header = ["corpus", "mode", "kiln MB/s", "tiktoken MB/s", "kiln ÷ tiktoken", "HF MB/s"]
    enc_header.append("same ids")
    dec_header = ["ids of", "call", "kiln MB/s", "tiktoken MB/s", "kiln ÷ tiktoken", "same output"]
    return {
        "encode_table": table(enc_header, rows),
        "decode_table": table(dec_header, decode_rows),
        "ratios": ratios,
        "mismatches": mismatches,
    }


def bench_decoding(
    tok: Any, enc: Any, ids: list[int], text: str, name: str, repeats: int
) -> tuple[list[list[str]], list[tuple[str, float, bool]]]:
    """`decode` (str) and `decode_bytes` (bytes), kiln vs tiktoken; a kiln error is reported."""
    nbytes = len(text.encode("utf-8"))
    rows, ratios = [], []
    calls = {
        "decode": (tok.decode, enc.decode, text),
        "decode_bytes": (tok.decode_bytes, enc.decode_bytes, text.encode("utf-8")),
    }
    for label, (kfn, tfn, expected) in calls.items():
        t_tik, out_tik = best_of(lambda tfn=tfn: tfn(ids), repeats)
        try:
            t_kiln, out_kiln = best_of(lambda kfn=kfn: kfn(ids), repeats)
        except Exception as exc:  # report, don't hide: the target line says "not measured"
            msg = f"kiln `{label}` failed: {type(exc).__name__}: {exc}"
            print(f"  decode {name} {label}: {msg}", flush=True)
            rows.append([name, f"`{label}`", f"**error** ({msg})", f"{mbps(nbytes, t_tik):.0f}"])
            rows[-1] += ["—", "—"]
            ratios.append((label, float("nan"), True))
            continue
        same = out_kiln == out_tik == expected
        ratio = t_tik / t_kiln
        ratios.append((label, ratio, same))
        rows.append(
            [
                name,
                f"`{label}`",
                f"{mbps(nbytes, t_kiln):.0f}",
                f"{mbps(nbytes, t_tik):.0f}",
                f"**{ratio:.2f}**",
                "yes" if same else "**NO**",
            ]
        )
        print(f"  decode {name} {label}: kiln/tiktoken {ratio:.2f}", flush=True)
    return rows, ratios


def bench_rustbpe_encode(corpora: Sequence[Path], train_corpus: Path, repeats: int) -> dict:
    """Encoding with a rustbpe-trained 32K vocabulary, rustbpe vs kiln on the same merges."""
    import rustbpe

    from kiln.tokenizer import Tokenizer
    from kiln.tokenizer.formats import merges_from_ranks
    from kiln.tokenizer.patterns import GPT2_PATTERN

    rb = rustbpe.Tokenizer()
    rb.train_from_iterator(iter_docs(train_corpus), 32000, pattern=GPT2_PATTERN)
    ranks = dict(rb.get_mergeable_ranks())
    tok = Tokenizer(
        {i: b for b, i in ranks.items()}, merges_from_ranks("rustbpe", ranks), pattern="gpt2"
    )
    rows, mismatches = [], []
    for path in corpora:
        text = read_text(path)
        docs = text.split(DOC_SEP)
        whole_bytes = len(text.encode("utf-8"))
        docs_bytes = sum(len(d.encode("utf-8")) for d in docs)
        cases = [
            ("1 thread, whole text", whole_bytes, tok.encode_ordinary, rb.encode, text),
            (
                "2 threads, batch of docs",
                docs_bytes,
                lambda d: tok.encode_batch(d, workers=2),
                rb.batch_encode,
                docs,
            ),
        ]
        for label, nbytes, kfn, rfn, arg in cases:
            t_k, ids_k = best_of(lambda kfn=kfn, arg=arg: kfn(arg), repeats)
            t_r, ids_r = best_of(lambda rfn=rfn, arg=arg: rfn(arg), repeats)
            same = ids_k == ids_r
            if not same:
                mismatches.append(f"{path.name}, {label}: kiln ids differ from rustbpe's")
            rk, rr = mbps(nbytes, t_k), mbps(nbytes, t_r)
            rows.append(
                [
                    path.name,
                    label,
                    f"{rk:.1f}",
                    f"{rr:.1f}",
                    f"{rk / rr:.2f}",
                    "yes" if same else "**NO**",
                ]
            )
    header = ["corpus", "mode", "kiln MB/s", "rustbpe MB/s", "kiln ÷ rustbpe", "same ids"]
    return {"table": table(header, rows), "mismatches": mismatches}


# ------------------------------------------------------------------------------------ reports
def verdict(name: str, value: float, target: float, higher: bool) -> str:
    """One line: target met / not met with the figure."""
    if value != value:  # NaN: the kiln call failed
        return f"- {name}: **not measured** (kiln raised an error, see the table)"
    ok = value >= target if higher else value <= target
    sign = "≥" if higher else "≤"
    return f"- {name}: {value:.2f}× (target {sign} {target}×) — **{'met' if ok else 'NOT met'}**"


def write_section(results_path: Path, section: str) -> None:
    """Add or replace the `## Tokenizer` section of RESULTS.md, leaving other sections alone."""
    if results_path.exists():
        text = results_path.read_text()
    else:
        text = "# Benchmark results\n\nFigures from the scripts in `bench/`; each section names its command.\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.strip() == "## Tokenizer"), None)
    if start is None:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        tail = "".join(lines[end:])
        text = "".join(lines[:start]) + section.rstrip("\n") + "\n" + ("\n" + tail if tail else "")
    with atomic_write(results_path) as handle:
        handle.write(text)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments; run a worker or the whole benchmark."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="train on en_10m, 1 repeat, no HF/rustbpe encode"
    )
    ap.add_argument("--repeats", type=int, default=None, help="best-of-N for encode/decode")
    ap.add_argument("--kiln-runs", type=int, default=None, help="training runs for kiln")
    ap.add_argument("--vocabs", type=int, nargs="+", default=[10_000, 32_000])
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-encode", action="store_true")
    ap.add_argument("--results", type=Path, help="write the `## Tokenizer` section into this file")
    ap.add_argument("--worker", choices=["train"], help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=TRAINERS, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    add_noisy_flag(ap)
    args = ap.parse_args(argv)

    if args.worker == "train":  # runs under its parent's measurement
        workdir = Path(tempfile.mkdtemp(prefix="train_", dir=SCRATCH))
        worker_main(args.impl, args.corpus, args.vocab, workdir)
        return
    measured = begin("bench/tokenizer.py", args.noisy)

    repeats = args.repeats or (1 if args.quick else 3)
    kiln_runs = args.kiln_runs or (1 if args.quick else 2)
    en100, en10, multi10 = (BENCH_DATA / f"{n}.txt.gz" for n in ("en_100m", "en_10m", "multi_10m"))
    train_corpus = en10 if args.quick else en100
    info = machine_info()
    cmd = "python bench/tokenizer.py" + (" --quick" if args.quick else "")
    print(f"# kiln tokenizer benchmark — {info['date']}")
    print(
        f"machine: {info['nproc']} cores, {info['cpu']}, {info['memory']}; Python {info['python']}"
    )
    print(f"versions: {info['versions']}\n", flush=True)

    parts = [
        "## Tokenizer",
        "",
        f"Command: `make bench-tokenizer` (runs `.venv/bin/{cmd}`). Date: {info['date']}.",
        f"Machine: {info['nproc']} cores ({info['cpu']}), {info['memory']} RAM; "
        f"Python {info['python']}; {info['versions']}.",
        "",
    ]
    machine_at = len(parts) - 1  # the measurement's line goes here once the run is done
    verdicts: list[str] = []
    mismatches: list[str] = []
    if not args.skip_train:
        print(f"training on {train_corpus.name} (each trainer in its own process)", flush=True)
        tr = bench_training(train_corpus, en10, args.vocabs, kiln_runs)
        parts += [
            f"### Training ({train_corpus.name}, wall time incl. reading the .gz, peak RSS)",
            "",
            "Each trainer runs alone in its own subprocess; time = reading and decompressing the "
            ".gz plus training (SentencePiece reads a plain-text copy written beforehand, not "
            "timed); peak = polled RSS of the process tree (and its ru_maxrss). kiln: "
            "`train_bpe([path], V, ['<|endoftext|>'], workers=2)`; rustbpe: "
            "`train_from_iterator(docs, V - 1, pattern=GPT2)` (same number of merges as kiln, "
            "which counts the special token in V); HF: BpeTrainer(V, special `<|endoftext|>`), "
            "ByteLevel; SentencePiece: BPE, byte_fallback, 2 threads. kiln best of "
            f"{kiln_runs} run(s), others 1 run.",
            "",
            tr["table"],
            "",
            *(f"Note: {n}" for n in tr["notes"]),
        ]
        for vocab in args.vocabs:
            k, r = tr["results"][("kiln", vocab)], tr["results"][("rustbpe", vocab)]
            label = f"{vocab // 1000}K on {train_corpus.name}"
            verdicts.append(
                verdict(
                    f"training time vs rustbpe, {label}", k["seconds"] / r["seconds"], 1.0, False
                )
            )
            verdicts.append(
                verdict(
                    f"training peak memory vs rustbpe, {label}",
                    k["peak_mb"] / r["peak_mb"],
                    1.5,
                    False,
                )
            )
        print("\n" + tr["table"] + "\n", flush=True)
    if not args.skip_encode:
        print("encoding/decoding with the GPT-2 vocabulary", flush=True)
        en = bench_encoding([en10, multi10], repeats, with_hf=not args.quick)
        mismatches += en["mismatches"]
        parts += [
            f"### Encoding, GPT-2 vocabulary (best of {repeats}; MB/s of UTF-8 input)",
            "",
            "kiln `Tokenizer.from_gpt2` vs a `tiktoken.Encoding` built offline from the same files "
            "and the same GPT-2 regex; HF `tokenizers` loads kiln's HF export of it. "
            "*Whole text*: `encode_ordinary(text)` on the whole corpus; *loop*: "
            "`encode_ordinary(doc)` per document (HF: `encode(doc)`); *batch*: kiln "
            "`encode_batch(docs, workers=2)`, tiktoken `encode_ordinary_batch(docs, "
            "num_threads=2)`, HF `encode_batch(docs)` (rayon, 2 cores).",
            "",
            en["encode_table"],
            "",
            f"### Decoding, GPT-2 vocabulary (best of {repeats}; MB/s of UTF-8 output)",
            "",
            en["decode_table"],
            "",
        ]
        for (corpus, label), ratio in en["ratios"].items():
            if label.startswith("decode"):
                verdicts.append(
                    verdict(f"decoding vs tiktoken, {corpus}, `{label}`", ratio, 1.0, True)
                )
            else:
                verdicts.append(
                    verdict(f"encoding vs tiktoken, {corpus}, {label}", ratio, 1.0, True)
                )
        print("\n" + en["encode_table"] + "\n\n" + en["decode_table"] + "\n", flush=True)
    if not args.skip_encode and not args.quick:  # optional peer; skipped by --quick
        print("encoding with a rustbpe-trained 32K vocabulary (trained on en_10m)", flush=True)
        rb = bench_rustbpe_encode([en10, multi10], en10, repeats)
        mismatches += rb["mismatches"]
        parts += [
            "### Encoding with a rustbpe-trained vocabulary (optional peer)",
            "",
            "rustbpe cannot load GPT-2's files, so it is trained here on en_10m to vocab 32K "
            "(GPT-2 regex) and kiln loads the same merges (`merges_from_ranks`). rustbpe `encode` "
            f"vs kiln `encode_ordinary`, rustbpe `batch_encode` (rayon, 2 cores) vs kiln "
            f"`encode_batch(workers=2)`; best of {repeats}.",
            "",
            rb["table"],
            "",
        ]
        print("\n" + rb["table"] + "\n", flush=True)
    if not args.skip_encode:
        verdicts.append(
            "- identical ids: **NO** — " + "; ".join(mismatches)
            if mismatches
            else "- identical ids (and decoded text) with every peer on the same vocabulary: yes"
        )
    parts += ["### Targets (issue 2)", "", *verdicts, ""]
    parts.insert(machine_at, measured.line())
    section = "\n".join(parts)
    print("\n".join(["### Targets", *verdicts]))
    print(parts[machine_at])
    if args.results:
        write_section(args.results, section)
        print(f"\nwrote the `## Tokenizer` section of {args.results}")


if __name__ == "__main__":
    main()
