"""Speculative decoding inside the engine: decode tokens/s at batch 1, 4 and 32, per drafter.

Target: the demo's model shape (kiln/assets/demo.toml, 4k vocabulary) with default-initialised
random weights, fp32, one torch thread. Prompts: a random 6-token phrase repeated to 48 tokens
(repetitive text, so prompt lookup has something to find), 64 new greedy tokens each, all
requests submitted at once. Configurations, each on a fresh engine with batch_invariant off
(a drafter needs it off; the baseline runs the same way so only the drafting differs):

- plain:      no drafter
- ngram:      prompt lookup
- self:L:     the target's own first L layers as the draft model (weights shared)
- NAME+always: NAME with the per-step switch off (speculate at any batch size): what the
              switch (speculative_max_batch = 8) saves at batch 32
- self:all:   the target drafting for itself: every draft is kept, so it shows the ceiling of
              tokens per target forward, and what drafting with a model as large as the
              target costs

With `--target RUN --draft RUN` (trained models, e.g. the demo run and a small drafter trained
or distilled on its data) the target is that run's model and the prompts are the first 32 tokens
of TinyStories validation stories (bench/distill_draft.py's); the configurations are then plain,
ngram, draft (the draft run's model) and draft+always.

Greedy outputs are checked equal to the plain engine's. Every configuration runs once per round,
interleaved, so load from other processes hits all alike; the median round is reported. A start
load above 1.5 means the numbers are noise: the script refuses unless --noisy.

    .venv/bin/python bench/spec_engine.py --noisy --rounds 1
    .venv/bin/python bench/spec_engine.py --target runs/demo --draft runs/draft   # ~4 min quiet
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from bench.serve import model_config
from kiln.model.transformer import Transformer
from kiln.serve.engine import Engine, EngineConfig, SamplingParams
from kiln.serve.engine.drafters import LookupDrafter, ModelDrafter, truncated


def prompts(n: int, vocab: int, length: int = 48, seed: int = 0) -> list[list[int]]:
    """n prompts, each a random 6-token phrase repeated to `length` tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        phrase = torch.randint(0, vocab, (6,), generator=g).tolist()
        out.append((phrase * (length // 6 + 1))[:length])
    return out


def drafter(name: str, model: Transformer, draft: Any = None) -> Any:
    """The drafter a configuration name stands for (None: plain); draft: --draft's loaded run."""
    if name == "plain":
        return None
    name = name.removesuffix("+always")
    if name == "ngram":
        return LookupDrafter()
    if name == "draft":
        if draft is None:
            raise SystemExit("--drafters: 'draft' needs --draft RUN")
        return ModelDrafter(draft.model, draft.autocast, name="draft")
    layers = model.cfg.n_layer if name == "self:all" else int(name.split(":")[1])
    return ModelDrafter(truncated(model, layers), name=name)


def run(model: Transformer, name: str, ps: list[list[int]], new: int, k: int,
        draft: Any = None, autocast: Any = None) -> dict[str, Any]:  # fmt: skip
    """One configuration on the prompts ps (one request each): decode tokens/s, acceptance."""
    batch = len(ps)
    config = EngineConfig(batch_invariant=False, max_num_seqs=max(batch, 1), speculative_k=k,
                          speculative_max_batch=1 << 20 if name.endswith("+always") else 8,
                          prefix_caching=False)  # fmt: skip
    engine = Engine(model, None, config, autocast=autocast, drafter=drafter(name, model, draft))
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    # Prefill first (one step per request's prompt), then time the decode alone.
    handles = [engine.submit(p, params) for p in ps]
    while any(h.first_token_time is None for h in handles):
        engine.step()
    done_before = engine.generated_tokens
    t0 = time.perf_counter()
    while not all(h.done for h in handles):
        engine.step()
    seconds = time.perf_counter() - t0
    out = [h.result()[0] for h in handles]
    tokens = engine.generated_tokens - done_before
    stats = engine.stats()
    return {
        "tok_s": tokens / seconds,
        "acceptance": stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else None,
        "spec_steps": stats.speculative_steps,
        "outputs": [c.token_ids for c in out],
    }


def main() -> int:
    """Run every configuration per batch size; print the table and write the JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,4,32")
    p.add_argument("--drafters", help="default: plain,ngram,ngram+always,self:1,self:all; "
                   "with --draft: plain,ngram,draft,draft+always")  # fmt: skip
    p.add_argument("--target", type=Path, help="a trained run as the target (with --draft)")
    p.add_argument("--draft", type=Path, help="a trained run as the draft model (with --target)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    add_noisy_flag(p)
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = p.parse_args()
    if (args.target is None) != (args.draft is None):
        p.error("--target and --draft go together: give both runs, or neither")
    batches = [int(b) for b in args.batches.split(",")]
    measured = begin("bench/spec_engine.py", args.noisy)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    draft = autocast = stories = None
    if args.target is not None:
        from bench.distill_draft import prompts as story_prompts
        from kiln.loading import load_model

        target = load_model(args.target, dtype="fp32")
        draft = load_model(args.draft, dtype="fp32")
        model, autocast = target.model, target.autocast
        stories = story_prompts(target.tokenizer, max(batches))
        if len(stories) < max(batches):
            raise SystemExit(f"only {len(stories)} TinyStories prompts of 32 tokens were found")
        print(f"# target {args.target} ({model.cfg.num_params() / 1e6:.1f}M), draft "
              f"{args.draft} ({draft.model.cfg.num_params() / 1e6:.1f}M), TinyStories prompts")  # fmt: skip
    else:
        model = Transformer(model_config("demo")).eval()
    default = (
        "plain,ngram,draft,draft+always" if draft else "plain,ngram,ngram+always,self:1,self:all"
    )
    names = (args.drafters or default).split(",")
    if "plain" not in names:
        p.error("--drafters must include plain (the baseline of every ratio)")
    results: dict[str, dict[str, Any]] = {}
    for batch in batches:
        ps = stories[:batch] if stories else prompts(batch, model.cfg.vocab_size)
        rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for _ in range(args.rounds):
            for name in names:
                rounds[name].append(run(model, name, ps, args.new_tokens, args.k, draft, autocast))
        base = statistics.median(r["tok_s"] for r in rounds["plain"])
        for name in names:
            r = rounds[name]
            if r[0]["outputs"] != rounds["plain"][0]["outputs"]:
                raise SystemExit(f"{name} at batch {batch}: greedy output differs from plain")
            tok_s = statistics.median(x["tok_s"] for x in r)
            acc = r[0]["acceptance"]
            results[f"{name}@{batch}"] = {"tok_s": tok_s, "speedup": tok_s / base,
                                          "acceptance": acc, "spec_steps": r[0]["spec_steps"]}  # fmt: skip
            shown = "-" if acc is None else f"{acc:.2f}"
            print(f"batch {batch:>2}  {name:<12} {tok_s:8.0f} tok/s  {tok_s / base:5.2f}x  "
                  f"acceptance {shown:>4}  speculative steps {r[0]['spec_steps']}", flush=True)  # fmt: skip
    print(measured.line())
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(measured.stamp(results), indent=1))
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
