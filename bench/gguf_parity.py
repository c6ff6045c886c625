"""kiln's GGUF exports in llama.cpp beside kiln itself: greedy parity and bits per byte.

A trained run is exported with `kiln export --gguf` at f32, f16, q8_0, q4_0 and q4_k_m
(llama.cpp's Q4_K/Q6_K mixture, quantized by kiln itself); llama.cpp
(llama-cpp-python) and kiln then score the very same token windows of TinyStories valid (the
first --docs stories, as one stream in --window-token windows, each window's first token not
scored), so their bits per byte compare directly: llama.cpp's f32/f16/q8_0/q4_0 against kiln's
fp32, int8 (per-row) and int4 (groups of 32, q4_0's block; also beside q4_k_m), with the head
quantized too where it is the (quantized) tied embedding, as in the GGUF files; every row also
has its ratio to kiln fp32 and the file's bytes per parameter. Greedy agreement: --prompts story
openings, --new-tokens each, kiln fp32 generate against each llama.cpp file.

    .venv/bin/python bench/gguf_parity.py --model runs/demo-<stamp>        # about a minute on the demo
    .venv/bin/python bench/gguf_parity.py --model runs/demo --docs 40 --threads 2

bytes = UTF-8 bytes of the scored tokens (end-of-text scores but has no bytes).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._llamacpp import LlamaCpp, available
from bench._load import add_noisy_flag, begin
from kiln.loading import load_checkpoint
from kiln.model.generate import generate
from kiln.quant.quantize import quantize_model
from kiln.tokenizer.special import EOT
from kiln.train.export_gguf import export_gguf

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
QUANTS = ("f32", "f16", "q8_0", "q4_0", "q4_k_m")


def stories(n: int) -> list[str]:
    """The first n TinyStories valid stories."""
    with gzip.open(SHARED / "tinystories" / "valid.txt.gz", "rt", encoding="utf-8") as f:
        text = f.read()
    return [s.strip() for s in text.split(EOT) if s.strip()][:n]


def nats_of(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed negative log-likelihood (nats) of targets under (T, V) logits."""
    x = logits.astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(x - top).sum(axis=1))
    return float((lse - x[np.arange(len(targets)), targets]).sum())


def score(logits_of: object, windows: list[list[int]], n_bytes: int) -> float:
    """Bits per byte over the windows, `logits_of(ids) -> (T, V)` the system's logits."""
    nats = 0.0
    for w in windows:
        nats += nats_of(logits_of(w)[:-1], np.asarray(w[1:]))  # type: ignore[operator]
    return nats / math.log(2) / n_bytes


def kiln_logits(model: torch.nn.Module, vocab: int) -> object:
    """ids -> (T, V) float32 logits of a kiln model."""

    def run(ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.tensor([ids]))[0, :, :vocab].float().numpy()

    return run


def main() -> None:
    """Export, score and print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True, help="a kiln run (kiln demo's folder, train/, ...)")
    ap.add_argument("--docs", type=int, default=100, help="TinyStories valid stories scored")
    ap.add_argument("--window", type=int, default=0, help="tokens per window (0: block_size)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    add_noisy_flag(ap)
    args = ap.parse_args()
    measured = begin("bench/gguf_parity.py", args.noisy)
    if not available():
        sys.exit("bench/gguf_parity.py needs llama-cpp-python: pip install -e '.[llamacpp]'")
    torch.set_num_threads(args.threads)
    loaded = load_checkpoint(args.model)
    model, tok = loaded.model.eval(), loaded.tokenizer
    assert tok is not None
    cfg = model.cfg
    eot = tok.special_tokens[loaded.eot_token]
    window = args.window or cfg.block_size
    texts = stories(args.docs)
    stream = [t for s in texts for t in (eot, *tok.encode_ordinary(s))]
    windows = [stream[i : i + window] for i in range(0, len(stream) - 1, window)]
    windows = [w for w in windows if len(w) > 1]
    n_bytes = sum(len(tok.decode_bytes([t])) for w in windows for t in w[1:] if t != eot)
    prompts = [[eot, *tok.encode_ordinary(s)[:12]] for s in stories(args.prompts)]
    print(f"# bench/gguf_parity.py {' '.join(sys.argv[1:])}: {loaded.path}, {len(windows)} windows of "
          f"{window} tokens ({sum(map(len, windows)):,} tokens, {n_bytes:,} bytes), "
          f"{args.threads} thread(s)")  # fmt: skip

    kiln_rows: dict[str, float] = {}
    reference = generate(model, prompts, args.new_tokens, temperature=0.0)
    variants = (("fp32", None, 0, False), ("int8", "int8", 64, False),
                ("int8 +head", "int8", 64, True), ("int4 g32", "int4", 32, False),
                ("int4 g32 +head", "int4", 32, True))  # fmt: skip
    for name, mode, group, head in variants:
        variant = model
        if mode is not None:
            variant = copy.deepcopy(model)
            quantize_model(variant, mode, group, head)
        t = time.perf_counter()
        kiln_rows[name] = score(kiln_logits(variant, cfg.vocab_size), windows, n_bytes)
        outs = generate(variant, prompts, args.new_tokens, temperature=0.0)
        same = sum(a == b for a, b in zip(outs, reference, strict=True))
        print(f"  kiln {name}: {kiln_rows[name]:.4f} bpb, greedy equal to fp32 on {same}/"
              f"{len(prompts)} prompts ({time.perf_counter() - t:.1f} s)", flush=True)  # fmt: skip

    print("\n| weights | llama.cpp bpb | kiln (same bits) bpb | llama ÷ kiln | llama ÷ kiln fp32 | "
          "greedy prompts equal to kiln fp32 | file MB | bytes/param |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    n_params = sum(p.numel() for p in model.parameters())
    # The GGUF files quantize the embedding too, which is the head when it is tied: so the
    # quantized files are set beside kiln's variants with the head quantized.
    head = "+head" if cfg.tie_embeddings else ""
    pairs = {"f32": "fp32", "f16": "fp32", "q8_0": f"int8 {head}".strip(),
             "q4_0": f"int4 g32 {head}".strip(), "q4_k_m": f"int4 g32 {head}".strip()}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for quant in QUANTS:
            path = Path(tmp) / f"{quant}.gguf"
            written = export_gguf(model, tok, loaded.eot_token, path, quant)
            llm = LlamaCpp(path, args.threads, n_seq=len(prompts), seq_len=max(window, 64) * 2)
            bpb = score(llm.logits, windows, n_bytes)
            outs = llm.greedy(prompts, [args.new_tokens] * len(prompts))
            same = sum(a == b for a, b in zip(outs, reference, strict=True))
            llm.close()
            k = kiln_rows[pairs[quant]]
            print(f"| {quant} | {bpb:.4f} | {pairs[quant]}: {k:.4f} | {bpb / k:.4f} | "
                  f"{bpb / kiln_rows['fp32']:.4f} | {same}/{len(prompts)} | "
                  f"{written.bytes / 1e6:.1f} | {written.bytes / n_params:.3f} |", flush=True)  # fmt: skip
    print(measured.line())


if __name__ == "__main__":
    main()
