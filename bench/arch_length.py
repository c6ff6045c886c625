"""Cost against length, and recall at a distance: attention, Mamba-2, Gated DeltaNet, a hybrid.

1. Cost (one model per kind, the same width and depth: 4 layers of width --width, SwiGLU MLPs,
   fp32, batch 1, one torch thread): at each sequence length, forward+backward seconds per
   token (best of --repeats, default 1), the bytes autograd saves for backward (saved-tensor hooks: the
   activation memory), and decode seconds per token after a prompt of that length (best of 8
   steps through kiln's KVCache) with the cache's bytes (KV for attention layers, a constant
   state for the recurrent ones). Kinds: attention (A), mamba2 (M), deltanet (D), hybrid
   (DDDA: three DeltaNet layers to one attention layer). A kind stops growing once one
   forward+backward cell took more than --cap seconds (noted in the table): attention's
   quadratic cost would otherwise dominate the run. Reported: the crossover length, the first
   measured length at which each recurrent kind costs less per token than attention
   (interpolated in log length between the two measured lengths around it).
   Peer, side by side: the same recurrent cores in transformers (Qwen3-Next's
   torch_chunk_gated_delta_rule; Mamba2ForCausalLM's torch path at the same sizes), forward +
   backward at two lengths, with the ratio.
2. Recall (multi-query associative recall with a gap): 4 key→value pairs, then D random filler
   tokens, then the 4 keys again in another order, each to be answered with its value (loss and accuracy on
   the answers only). Each kind (4 layers, width 64) trains for --recall-budget CPU seconds on
   gaps drawn from 0..max(--distances), then is scored on 256 fresh sequences per distance.

    .venv/bin/python bench/arch_length.py                  # ~6 min on a quiet 2-core CPU
    .venv/bin/python bench/arch_length.py --tiny --noisy   # seconds: a smoke test
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from kiln.io import write_json_atomic
from kiln.model import ModelConfig
from kiln.model.transformer import Transformer

KINDS = {"attention": "A", "mamba2": "M", "deltanet": "D", "hybrid": "DDDA"}
VOCAB = 256


def model_config(pattern: str, width: int, block: int, vocab: int = VOCAB) -> ModelConfig:
    """4 layers of `width`, the demo's Llama-style switches, `pattern` mixers."""
    heads = max(1, width // 64)
    ssm = {"head_dim": min(64, width), "state_size": 64 if width >= 128 else 16, "chunk_size": 64}
    return ModelConfig.preset(
        "tiny", vocab_size=vocab, block_size=block, n_layer=4, n_embd=width, n_head=heads,
        n_kv_head=heads, layer_pattern=pattern, ssm=ssm,
    )  # fmt: skip


def saved_bytes(model: Transformer, x: torch.Tensor) -> tuple[float, int]:
    """(forward+backward seconds, bytes of distinct storages saved for backward)."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            saved[s.data_ptr()] = s.nbytes()
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x)
    loss.backward()
    return time.perf_counter() - t0, sum(saved.values())


def train_cost(model: Transformer, T: int, repeats: int) -> tuple[float, int]:
    """Best forward+backward seconds per token at length T, and the saved bytes."""
    x = torch.randint(0, VOCAB, (1, T))
    best, mem = math.inf, 0
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        seconds, mem = saved_bytes(model, x)
        best = min(best, seconds)
    return best / T, mem


@torch.inference_mode()
def decode_cost(model: Transformer, T: int, steps: int = 8) -> tuple[float, int]:
    """Best seconds of one decode step after a T-token prompt, and the cache's bytes then."""
    from kiln.model.generate import decode_step
    from kiln.model.kv_cache import KVCache

    cache = KVCache(model.cfg, 1, T + steps)
    decode_step(model, torch.randint(0, VOCAB, (1, T)), cache)
    best = math.inf
    for _ in range(steps):
        t0 = time.perf_counter()
        decode_step(model, torch.randint(0, VOCAB, (1, 1)), cache)
        best = min(best, time.perf_counter() - t0)
    kv = sum(t.numel() * t.element_size() * T // (T + steps) for t in cache.k + cache.v)
    state = sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                for a, b in cache.states.values())  # fmt: skip
    return best, kv + state


def crossover(lengths: list[int], attn: list[float], other: list[float]) -> float | None:
    """First length where `other` per-token cost drops below attention's (log-interpolated)."""
    prev = None
    for T, a, o in zip(lengths, attn, other, strict=False):
        if o < a:
            if prev is None:
                return float(T)
            (T0, r0), r1 = prev, math.log(o / a)
            frac = r0 / (r0 - r1)
            return float(math.exp(math.log(T0) + frac * (math.log(T) - math.log(T0))))
        prev = (T, math.log(o / a))
    return None


def cost_section(lengths: list[int], width: int, repeats: int, cap: float) -> dict[str, Any]:
    """Part 1: the cost table for every kind (a kind stops after a cell over `cap` seconds)."""
    out: dict[str, Any] = {}
    for kind, pattern in KINDS.items():
        torch.manual_seed(0)
        model = Transformer(model_config(pattern, width, max(lengths) + 16))
        train_cost(model, lengths[0], 1)  # warm-up: the first call pays for one-time set-up
        rows = []
        for T in lengths:
            t0 = time.perf_counter()
            per_token, mem = train_cost(model, T, repeats)
            decode_s, cache_bytes = decode_cost(model.eval(), T)
            model.train()
            rows.append({"T": T, "fwd_bwd_us_per_token": per_token * 1e6, "saved_MiB": mem / 2**20,
                         "decode_ms": decode_s * 1e3, "cache_KiB": cache_bytes / 1024})  # fmt: skip
            print(f"  {kind:9s} T={T:6d}: fwd+bwd {per_token * 1e6:8.1f} µs/token, saved "
                  f"{mem / 2**20:8.1f} MiB, decode {decode_s * 1e3:6.2f} ms, cache "
                  f"{cache_bytes / 1024:8.0f} KiB ({time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
            if per_token * T > cap:
                break
        out[kind] = {"rows": rows, "capped_at": rows[-1]["T"] if len(rows) < len(lengths) else None}
    attn = out["attention"]["rows"]
    for kind in ("mamba2", "deltanet", "hybrid"):
        rows = out[kind]["rows"]
        n = min(len(attn), len(rows))
        ls = [r["T"] for r in rows[:n]]
        out[kind]["train_crossover"] = crossover(
            ls, [r["fwd_bwd_us_per_token"] for r in attn[:n]],
            [r["fwd_bwd_us_per_token"] for r in rows[:n]],
        )  # fmt: skip
        out[kind]["decode_crossover"] = crossover(
            ls, [r["decode_ms"] for r in attn[:n]], [r["decode_ms"] for r in rows[:n]]
        )
    return out


def peer_section(lengths: list[int], width: int) -> list[dict[str, Any]]:
    """kiln's DeltaNet core and Mamba-2 model against transformers' torch paths, fwd+bwd."""
    import transformers
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen

    from kiln.model.ssm import delta_rule_chunked

    rows = []
    for T in lengths:
        H, D = max(1, width // 64), min(64, width)
        g = torch.Generator().manual_seed(0)
        q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=g), dim=-1)
                for _ in range(2))  # fmt: skip
        v = torch.randn(1, T, H, D, generator=g)
        beta, decay = torch.rand(1, T, H, generator=g), -torch.rand(1, T, H, generator=g)
        times = {}
        for name, fn in (
            ("kiln", lambda a, b, c, d, e, D=D: delta_rule_chunked(a * D**-0.5, b, c, d, e, 64)[0]),
            ("transformers", lambda a, b, c, d, e: qwen.torch_chunk_gated_delta_rule(
                a, b, c, e, d, chunk_size=64)[0]),
        ):  # fmt: skip
            times[name] = math.inf
            for _ in range(2):  # best of two: the first call pays for warming up
                leaves = [t.clone().requires_grad_() for t in (q, k, v, beta, decay)]
                t0 = time.perf_counter()
                fn(*leaves).sum().backward()
                times[name] = min(times[name], time.perf_counter() - t0)
        rows.append({"what": "DeltaNet core (chunked, fwd+bwd)", "T": T, **times})
        cfg = model_config("M", width, T + 1)
        kiln_model = Transformer(ModelConfig.from_dict({**cfg.to_dict(), "mlp": "none"}))
        hf_cfg = transformers.Mamba2Config(
            vocab_size=VOCAB, hidden_size=width, num_hidden_layers=4, head_dim=cfg.ssm.head_dim,
            num_heads=cfg.mamba_heads, state_size=cfg.ssm.state_size, n_groups=1, expand=2,
            chunk_size=64, use_bias=False,
        )  # fmt: skip
        hf_model = transformers.Mamba2ForCausalLM(hf_cfg)
        x = torch.randint(0, VOCAB, (1, T))
        t0 = time.perf_counter()
        kiln_model(x, x).backward()
        kiln_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf_model(x, labels=x).loss.backward()
        rows.append({"what": "Mamba-2, 4 layers (fwd+bwd)", "T": T, "kiln": kiln_s,
                     "transformers": time.perf_counter() - t0})  # fmt: skip
    return rows


# ---- recall -------------------------------------------------------------------------------------

# ids: keys, then values, then filler. 4 pairs of 16 keys: 8 pairs of 32 stayed at chance for
# attention after 30 CPU seconds here; this size is learnt in that time (0.2 at 440 steps).
N_PAIRS, N_QUERIES, KEYS, VALUES, FILLER = 4, 4, 16, 16, 32


def recall_batch(n: int, gap: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs (n, T), targets (n, T) with -100 except at the answers) at filler distance `gap`."""
    keys = torch.stack([torch.randperm(KEYS, generator=gen)[:N_PAIRS] for _ in range(n)])
    values = KEYS + torch.randint(0, VALUES, (n, N_PAIRS), generator=gen)
    pairs = torch.stack([keys, values], dim=2).flatten(1)  # (n, 2·pairs): k v k v ...
    filler = KEYS + VALUES + torch.randint(0, FILLER, (n, gap), generator=gen)
    pick = torch.stack([torch.randperm(N_PAIRS, generator=gen)[:N_QUERIES] for _ in range(n)])
    queries = torch.stack([keys.gather(1, pick), values.gather(1, pick)], dim=2).flatten(1)
    seq = torch.cat([pairs, filler, queries], dim=1)  # (n, T+1)
    targets = torch.full_like(seq[:, 1:], -100)
    answer_at = seq.size(1) - 2 * N_QUERIES + 2 * torch.arange(N_QUERIES)  # positions of values
    targets[:, answer_at - 1] = seq[:, answer_at]
    return seq[:, :-1], targets


def recall_section(
    distances: list[int],
    budget: float,
    width: int,
    steps_cap: int | None = None,
    kinds: list[str] | None = None,
) -> dict[str, Any]:
    """Part 2: accuracy by distance per kind after `budget` CPU seconds (or `steps_cap` steps)."""
    import torch.nn.functional as F

    vocab = KEYS + VALUES + FILLER
    out = {}
    for kind, pattern in KINDS.items():
        if kinds and kind not in kinds:
            continue
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        model = Transformer(model_config(pattern, width, max(distances) + 64, vocab))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        start, steps = time.process_time(), 0
        while (steps < steps_cap) if steps_cap else (time.process_time() - start < budget):
            gap = int(torch.randint(0, max(distances) + 1, (1,), generator=gen))
            x, y = recall_batch(32, gap, gen)
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
        model.eval()
        acc = {}
        eval_gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for d in distances:
                x, y = recall_batch(256, d, eval_gen)
                pred = model(x).argmax(-1)
                mask = y != -100
                acc[d] = float((pred[mask] == y[mask]).float().mean())
        out[kind] = {
            "steps": steps,
            "cpu_s": round(time.process_time() - start, 1),
            "accuracy": acc,
        }
        print(f"  {kind:9s}: {steps} steps; accuracy by distance "
              + ", ".join(f"{d}: {a:.2f}" for d, a in acc.items()), flush=True)  # fmt: skip
    return out


def plot_cost(cost: dict[str, Any], path: Path) -> None:
    """Training and decode cost per token against sequence length, one line per kind."""
    from kiln.plotting import pyplot, save_png

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = (("fwd_bwd_us_per_token", "fwd+bwd µs per token"), ("decode_ms", "decode ms per step"))
    for ax, (field, label) in zip(axes, panels, strict=True):
        for kind, v in cost.items():
            rows = v["rows"]
            ax.plot([r["T"] for r in rows], [r[field] for r in rows], marker="o", label=kind)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle("Cost against length: attention against the recurrent layers (1 thread)")
    save_png(fig, path)


def print_cost(cost: dict[str, Any]) -> None:
    """The cost table and the crossovers."""
    lengths = [r["T"] for r in cost["attention"]["rows"]]
    longest = max((len(v["rows"]) for v in cost.values()), default=0)
    lengths = [r["T"] for v in cost.values() if len(v["rows"]) == longest for r in v["rows"]][
        :longest
    ]
    print("\n| kind | " + " | ".join(f"T={T}" for T in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for field, unit in (("fwd_bwd_us_per_token", "µs/tok fwd+bwd"), ("saved_MiB", "MiB saved"),
                        ("decode_ms", "ms/decode step"), ("cache_KiB", "KiB cache")):  # fmt: skip
        for kind, v in cost.items():
            cells = [f"{r[field]:,.1f}" for r in v["rows"]]
            cells += ["(capped)"] * (len(lengths) - len(cells))
            print(f"| {kind} {unit} | " + " | ".join(cells) + " |")
    for kind in ("mamba2", "deltanet", "hybrid"):
        tc, dc = cost[kind]["train_crossover"], cost[kind]["decode_crossover"]
        print(f"crossover {kind} vs attention: training "
              f"{'none in range' if tc is None else f'~{tc:,.0f} tokens'}, decode "
              f"{'none in range' if dc is None else f'~{dc:,.0f} tokens'}")  # fmt: skip


def print_tables(cost: dict[str, Any], peer: list[dict[str, Any]], recall: dict[str, Any]) -> None:
    """The three markdown tables."""
    if cost:
        print_cost(cost)
    if peer:
        print("\n| peer check | T | kiln s | transformers s | transformers / kiln |")
        print("|---|---:|---:|---:|---:|")
        for r in peer:
            print(f"| {r['what']} | {r['T']} | {r['kiln']:.3f} | {r['transformers']:.3f} | "
                  f"{r['transformers'] / r['kiln']:.2f} |")  # fmt: skip
    if not recall:
        return
    distances = list(next(iter(recall.values()))["accuracy"])
    print("\n| kind | steps | " + " | ".join(f"acc @ {d}" for d in distances) + " |")
    print("|---|---:|" + "---:|" * len(distances))
    for kind, v in recall.items():
        print(
            f"| {kind} | {v['steps']} | "
            + " | ".join(f"{a:.2f}" for a in v["accuracy"].values())
            + " |"
        )


def main() -> int:
    """Run both parts; print the tables; write JSON under --out-dir."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/kiln-bench-arch-length"))
    ap.add_argument("--lengths", default="256,512,1024,2048,4096,8192,16384")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="fwd+bwd runs per cell (best)")
    ap.add_argument("--cap", type=float, default=25.0, help="seconds: a kind's last cell")
    ap.add_argument("--distances", default="0,16,64,128")
    ap.add_argument("--recall-budget", type=float, default=45.0, help="CPU seconds per kind")
    ap.add_argument("--recall-steps", type=int, default=None,
                    help="train each kind for this many steps instead of --recall-budget")  # fmt: skip
    ap.add_argument("--parts", default="cost,recall", help="which parts to run")
    ap.add_argument("--kinds", default="", help="recall: only these kinds (comma list)")
    ap.add_argument("--tiny", action="store_true", help="two short lengths, seconds of recall")
    add_noisy_flag(ap)
    args = ap.parse_args()
    measured = begin("bench/arch_length.py", args.noisy)
    torch.set_num_threads(1)
    if args.tiny:
        args.lengths, args.width, args.repeats, args.distances = "64,128", 64, 1, "0,8"
        args.recall_budget = 1.0
    lengths = [int(t) for t in args.lengths.split(",")]
    distances = [int(d) for d in args.distances.split(",")]
    parts = set(args.parts.split(","))
    if not parts or not parts <= {"cost", "recall"}:
        ap.error(f"--parts: a comma list of cost, recall; got {args.parts!r}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cost, peer, recall = {}, [], {}
    if "cost" in parts:
        print("cost against length:", flush=True)
        cost = cost_section(lengths, args.width, args.repeats, args.cap)
        print("peer (transformers' torch paths):", flush=True)
        peer = peer_section([lengths[0], lengths[min(2, len(lengths) - 1)]], args.width)
        plot_cost(cost, args.out_dir / "arch_length.png")
    if "recall" in parts:
        print("recall at a distance:", flush=True)
        kinds = [k for k in args.kinds.split(",") if k]
        if unknown := sorted(set(kinds) - set(KINDS)):
            ap.error(f"--kinds: unknown {unknown}; the kinds are {', '.join(KINDS)}")
        recall = recall_section(distances, args.recall_budget, 64, args.recall_steps, kinds)
    print_tables(cost, peer, recall)
    doc = {"width": args.width, "lengths": lengths, "cost": cost, "peer": peer, "recall": recall}
    write_json_atomic(args.out_dir / "arch_length.json", measured.stamp(doc))
    print(measured.line())
    print(f"wrote {args.out_dir / 'arch_length.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
