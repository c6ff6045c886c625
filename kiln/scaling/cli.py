"""`kiln scaling account|plan|sweep|run|fit|mup-check`: accounting, plans, IsoFLOP sweeps and their
fits, and µP's coordinate check."""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

ACCOUNT_EXAMPLES = """examples:
  kiln scaling account gpt2-124m --seq-len 1024 --micro-batch 8
  kiln scaling account llama-1b --seq-len 4096
  kiln scaling account configs/tiny.toml          # a train config: its model, seq_len, batch
  kiln scaling account model.json --json"""

PLAN_EXAMPLES = """examples:
  kiln scaling plan --flops 1e21 --gpu h100 --n 8 --mfu 0.4
  kiln scaling plan --params 1e9 --law epoch --gpu a100 --n 64
  kiln scaling plan --tokens 2e11 --law 20x --family gpt2 --seq-len 1024
  kiln scaling plan --hours 1 --gpu h200 --n 1 --law fit/fit.json --unique-tokens 1.44e6
  kiln scaling plan --hours 1 --rate 3e11 --law fit/fit.json --vocab-size 4096 --seq-len 256
  kiln scaling plan --hours 1 --rate 3e11 --unique-tokens 1.44e6 --max-epochs 5 --seq-len 256"""

SWEEP_EXAMPLES = """examples:
  kiln scaling sweep --base configs/tiny.toml --set data.dataset=data/tiny \\
      --budgets 3e11,1e12 --sizes 1x32,2x64,3x96 --out sweeps/tiny --run
  kiln scaling run sweeps/tiny                   # train what is not finished yet
  kiln scaling fit sweeps/tiny --out sweeps/tiny/fit"""

RUN_EXAMPLES = """examples:
  kiln scaling run sweeps/tiny     # skips finished runs, resumes an interrupted one"""

FIT_EXAMPLES = """examples:
  kiln scaling fit sweeps/tiny --out sweeps/tiny/fit
  kiln scaling fit results.csv --out fit --starts 0   # columns: params,tokens,budget,loss"""


MUP_CHECK_EXAMPLES = """examples:
  kiln scaling mup-check --plot docs/images/mup_coord_check.png
  kiln scaling mup-check --widths 32,64,128,256 --steps 4 --optimizer muon --json"""


def register(sub: Any) -> None:
    """Add `kiln scaling` and its subcommands to the `kiln` parser."""
    from kiln.commands import add_command_group, add_subcommand

    group = add_command_group(
        sub, "scaling", "parameter/FLOP/memory accounting, compute-optimal plans, scaling fits",
        "Accounting of a model config, compute-optimal plans (Chinchilla, Epoch AI, 20 tokens\n"
        "per parameter), IsoFLOP sweeps trained with kiln's trainer, and scaling-law fits.",
        "kiln scaling plan --flops 1e21 --gpu h100 --n 8",
    )  # fmt: skip
    p = add_subcommand(
        group, "account", "parameters by component, FLOPs per token, training memory",
        ACCOUNT_EXAMPLES,
    )  # fmt: skip
    p.add_argument("model", metavar="MODEL", help="preset name, model config (.json/.toml), or "
                   "a train config TOML")  # fmt: skip
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: block_size)")
    p.add_argument("--micro-batch", type=int, help="sequences per micro-batch (default 1)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(handler=run_account)

    p = add_subcommand(group, "plan", "compute-optimal N and D, a model shape, time and cost",
                       PLAN_EXAMPLES)  # fmt: skip
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--flops", type=float, help="training compute C in FLOPs")
    given.add_argument("--params", type=float, help="model size N in parameters")
    given.add_argument("--tokens", type=float, help="training tokens D")
    given.add_argument("--hours", type=float, help="training time: the budget that fills it")
    p.add_argument(
        "--law",
        default="chinchilla",
        help="chinchilla (default), epoch, 20x, or a `kiln scaling fit` fit.json",
    )
    p.add_argument(
        "--rate",
        type=float,
        metavar="FLOP/S",
        help="measured training FLOP/s (exact count) instead of --gpu's peak × --mfu",
    )
    p.add_argument(
        "--unique-tokens",
        type=float,
        metavar="U",
        help="distinct tokens in the data: epochs, repeated data's effective tokens "
        "(Muennighoff et al. 2023), and with a fitted law N chosen for them",
    )
    p.add_argument(
        "--max-epochs",
        type=float,
        metavar="E",
        help="at most E passes over --unique-tokens; the compute left goes to the model's size",
    )
    p.add_argument("--gpu", default="h100", help="accelerator (h100, h100-pcie, h200, b200, "
                   "a100, l40s, v100, ...)")  # fmt: skip
    p.add_argument("--n", type=int, default=8, help="number of GPUs (default 8)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation (default 0.4)")
    p.add_argument("--precision", default="bf16", help="peak to use: bf16 (default), fp8, ...")
    p.add_argument("--family", default="llama", help="shape family: llama (default) or gpt2")
    p.add_argument("--vocab-size", type=int, help="vocabulary (default: the family's presets')")
    p.add_argument("--seq-len", type=int, default=2048, help="training sequence length")
    p.add_argument("--usd-per-gpu-hour", type=float, help="price, to print a cost")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=run_plan)

    p = add_subcommand(group, "sweep", "write (and optionally run) an IsoFLOP sweep",
                       SWEEP_EXAMPLES)  # fmt: skip
    p.add_argument("--base", required=True, metavar="CONFIG.toml", help="base train config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a base config value (repeatable)")  # fmt: skip
    p.add_argument("--budgets", required=True, help="FLOP budgets, e.g. 1e12,3e12,1e13")
    p.add_argument("--sizes", required=True, help="shapes N_LAYERxN_EMBD, e.g. 1x32,2x64,4x128")
    p.add_argument("--out", required=True, metavar="DIR", help="sweep directory")
    p.add_argument("--min-steps", type=int, default=5, help="leave out runs shorter than this")
    p.add_argument("--run", action="store_true", help="train the runs now")
    p.add_argument("--force", action="store_true", help="replace an existing sweep.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_sweep_cmd)

    p = add_subcommand(group, "run", "train a sweep's unfinished runs", RUN_EXAMPLES)
    p.add_argument("sweep", metavar="DIR", help="sweep directory (with sweep.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_run)

    p = add_subcommand(group, "fit", "fit IsoFLOP parabolas, power laws and L(N, D); plot them",
                       FIT_EXAMPLES)  # fmt: skip
    p.add_argument("results", metavar="RESULTS", help="results.csv or a sweep directory")
    p.add_argument("--out", required=True, metavar="DIR", help="where fit.json and PNGs go")
    p.add_argument("--starts", type=int, default=64,
                   help="L-BFGS runs, from the best-scoring points of Hoffmann et al.'s grid "
                   "of 4,500 starts (default 64; 0: all of them)")  # fmt: skip
    p.add_argument(
        "--min-budget",
        type=float,
        default=0.0,
        help="leave out runs of budgets below this many FLOPs (e.g. step-starved ones)",
    )
    p.add_argument(
        "--keep-extrapolated",
        action="store_true",
        help="use IsoFLOP minima outside a budget's sizes in the power laws too",
    )
    p.add_argument(
        "--force", action="store_true", help="replace an existing fit.json and its figures"
    )
    p.set_defaults(handler=run_fit)

    p = add_subcommand(group, "mup-check",
                       "activation size per layer across widths after a few steps, SP vs µP",
                       MUP_CHECK_EXAMPLES)  # fmt: skip
    p.add_argument("--widths", default="64,128,256,512",
                   help="comma-separated n_embd values; µP's base is the smallest (default "
                   "64,128,256,512)")  # fmt: skip
    p.add_argument("--steps", type=int, default=5, help="updates before measuring (default 5)")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate (default 0.02)")
    p.add_argument("--optimizer", default="adamw", help="adamw (default) or muon")
    p.add_argument("--layers", type=int, default=2, help="n_layer of the model (default 2)")
    p.add_argument("--plot", type=Path, metavar="PNG", help="write the curves as this PNG")
    p.add_argument("--force", action="store_true", help="replace an existing --plot file")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=run_mup_check)


# ---- account -----------------------------------------------------------------------------------


def load_model(spec: str) -> tuple[Any, int | None, int | None]:
    """(ModelConfig, seq_len, micro_batch) from a preset, a model config, or a train config."""
    from kiln import config as cfgio
    from kiln.model.config import PRESETS, ModelConfig

    if spec in PRESETS or spec.startswith("depth-"):  # depth-N, depth-N-mup: derived presets
        return ModelConfig.preset(spec), None, None
    path = Path(spec)
    if not path.is_file():
        raise KilnError(f"{spec}: neither a preset ({', '.join(PRESETS)}) nor a file")
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise KilnError(f"{path}: not valid TOML ({exc})") from None
        if "data" in data and isinstance(data.get("model"), dict):
            return _train_config_model(path)
        return cfgio.load(ModelConfig, path), None, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KilnError(f"{path}: not a .toml file nor valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise KilnError(f"{path}: expected a JSON object of model config fields")
    try:
        return ModelConfig.from_dict(data), None, None
    except KilnError as exc:
        raise KilnError(f"{path}: {exc}") from None


def _train_config_model(path: Path) -> tuple[Any, int | None, int | None]:
    """The model of a train config, with the dataset's vocabulary when it is not set."""
    from kiln.train.config import load_train_config

    cfg = load_train_config(path)
    vocab = None
    if "vocab_size" not in cfg.model:
        from kiln.data.manifest import Manifest

        try:  # the manifest alone: no shard needs opening to learn the vocabulary
            vocab = Manifest.read(Path(cfg.data.dataset)).tokenizer.vocab_size
        except KilnError:
            raise KilnError(
                f"{path}: model.vocab_size is unset and the dataset {cfg.data.dataset} cannot "
                "be opened to read it; set model.vocab_size"
            ) from None
    return cfg.model_config(vocab), cfg.data.seq_len, cfg.batch.micro_batch


def account_report(cfg: Any, seq_len: int, micro_batch: int) -> dict[str, Any]:
    """Everything `kiln scaling account` prints, as plain data."""
    from kiln.model.accounting import (
        PRECISION_BYTES,
        flop_count,
        memory_estimate,
        non_embedding_params,
    )

    full, causal = flop_count(cfg, seq_len), flop_count(cfg, seq_len, causal=True)
    memory = {}
    for precision in PRECISION_BYTES:
        for ckpt in (False, True):
            m = memory_estimate(cfg, micro_batch, seq_len, precision, "adamw", ckpt)
            memory[f"{precision}{' +ckpt' if ckpt else ''}"] = {
                "weights": m.weights, "gradients": m.gradients, "master": m.master_weights,
                "optimizer": m.optimizer, "activations": m.activations, "total": m.total,
            }  # fmt: skip
    return {
        "params": {
            **cfg.param_breakdown(),
            "total": cfg.num_params(),
            "non_embedding": non_embedding_params(cfg),
            "matmul": cfg.num_matmul_params(),
            "active": cfg.num_active_params(),  # MoE: the experts one token uses
        },
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "flops_per_token": {
            "forward_matmul": full.forward_matmul,
            "forward_attention": full.forward_attention,
            "forward": full.forward,
            "backward": full.backward,
            "total": full.total,
            "six_n": full.six_n,
            "total_causal": causal.total,
        },
        "memory_bytes": memory,
    }


def run_account(args: argparse.Namespace) -> int:
    """Print the accounting tables (or JSON)."""
    cfg, seq_len, micro_batch = load_model(args.model)
    seq_len = args.seq_len or seq_len or cfg.block_size
    micro_batch = args.micro_batch or micro_batch or 1
    if seq_len < 1 or micro_batch < 1:
        raise KilnError("--seq-len and --micro-batch must be >= 1")
    report = account_report(cfg, seq_len, micro_batch)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    total = report["params"]["total"]
    print(f"parameters ({cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_head} heads)")
    for name in ("embeddings", "attention", "mlp", "norms", "head", "total"):
        value = report["params"][name]
        print(f"  {name:<14}{value:>16,}  {100 * value / total:5.1f}%")
    print(f"  {'non-embedding':<14}{report['params']['non_embedding']:>16,}")
    if cfg.moe is not None:
        print(f"  {'active/token':<14}{report['params']['active']:>16,}")
    f = report["flops_per_token"]
    print(f"\nFLOPs per token at T = {seq_len} (2 per multiply-add; attention over full T×T)")
    for label, key in (("forward: matmuls", "forward_matmul"),
                       ("forward: attention", "forward_attention"), ("forward", "forward"),
                       ("backward (2×fwd)", "backward"), ("training total", "total"),
                       ("causal total", "total_causal"), ("6N approximation", "six_n")):  # fmt: skip
        print(f"  {label:<20}{f[key]:>18,.0f}  {f[key] / f['total']:6.3f}× total")
    biggest = max(parts["total"] for parts in report["memory_bytes"].values())
    unit, scale = ("GiB", 2**30) if biggest >= 2**30 else ("MiB", 2**20)
    print(f"\ntraining memory, AdamW, micro-batch {micro_batch} × {seq_len} tokens ({unit})")
    cols = ("weights", "gradients", "master", "optimizer", "activations", "total")
    print(f"  {'precision':<16}" + "".join(f"{c:>12}" for c in cols))
    for name, parts in report["memory_bytes"].items():
        print(f"  {name:<16}" + "".join(f"{parts[c] / scale:>12.3f}" for c in cols))
    print("  (amp-bf16 = kiln's trainer: fp32 weights, bf16 autocast; bf16 = 16-bit weights "
          "with an fp32 master copy; +ckpt = activation checkpointing per block)")  # fmt: skip
    return 0


# ---- plan --------------------------------------------------------------------------------------


def run_plan(args: argparse.Namespace) -> int:
    """Print a compute-optimal plan."""
    from kiln.hardware import accelerator
    from kiln.scaling.laws import get_law
    from kiln.scaling.plan import make_plan, plan_for_time

    hardware = dict(
        gpu=accelerator(args.gpu), n_gpus=args.n, mfu=args.mfu, precision=args.precision,
        family=args.family, vocab_size=args.vocab_size, seq_len=args.seq_len, rate=args.rate,
        unique_tokens=args.unique_tokens, max_epochs=args.max_epochs,
    )  # fmt: skip
    law = get_law(args.law)
    if args.hours is not None:
        plan = plan_for_time(law, args.hours * 3600, **hardware)
    else:
        plan = make_plan(law, flops=args.flops, params=args.params, tokens=args.tokens, **hardware)
    cost = None if args.usd_per_gpu_hour is None else plan.gpu_hours * args.usd_per_gpu_hour
    if args.json:
        print(json.dumps({**plan.to_dict(), "usd": cost}, indent=2))
        return 0
    s = plan.shape
    loss = f"; predicted loss {plan.loss:.3f} (on the law's own data)" if plan.loss else ""
    print(f"law          {plan.law}{loss}")
    print(f"compute      C = {plan.flops:.3g} FLOPs (6·N·D)")
    print(f"parameters   N = {plan.params:.3g}")
    print(f"tokens       D = {plan.tokens:.3g} ({plan.tokens / plan.params:.1f} per parameter)")
    if plan.epochs is not None:
        print(f"data         {plan.epochs:.1f} epochs of {plan.unique_tokens:.3g} unique tokens; "
              f"effective tokens {plan.effective_tokens:.3g}, effective parameters "
              f"{plan.effective_params or plan.params:.3g} (Muennighoff et al. 2023)")  # fmt: skip
    print(f"shape        {args.family} {s.label}: n_layer {s.config.n_layer}, n_embd "
          f"{s.config.n_embd}, n_head {s.config.n_head}, kv heads {s.config.kv_heads}, d_ff "
          f"{s.config.ff_size}, vocab {s.config.vocab_size:,} -> {s.params:,} parameters")  # fmt: skip
    print(f"exact FLOPs  {plan.train_flops:.3g} (with attention at T = {args.seq_len})")
    where = (
        f"at the measured {plan.rate:.3g} FLOP/s"
        if plan.rate is not None
        else f"on {plan.n_gpus} × {plan.gpu} ({plan.precision}, MFU {plan.mfu:.0%}) = "
        f"{plan.gpu_hours:,.1f} GPU-hours"
    )
    print(f"time         {_duration(plan.seconds)} {where}, from the exact FLOPs "
          f"({_duration(plan.seconds_6nd)} from 6·N·D)")  # fmt: skip
    activations = "fp32" if plan.precision in ("fp32", "tf32") else "bf16 autocast"
    print(
        f"memory/GPU   {plan.memory_per_gpu / 2**30:.1f} GiB (states sharded over "
        f"{plan.n_gpus} GPUs, AdamW, {activations}, 1 × {args.seq_len} tokens of activations)"
    )
    if cost is not None:
        print(f"cost         ${cost:,.0f} at ${args.usd_per_gpu_hour}/GPU-hour")
    return 0


def _duration(seconds: float) -> str:
    """Seconds as a readable duration."""
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:.1f} s"


# ---- sweep, run, fit ---------------------------------------------------------------------------


def run_sweep_cmd(args: argparse.Namespace) -> int:
    """Write the sweep and run it if asked."""
    from kiln.scaling.sweep import parse_floats, parse_shape, write_sweep

    budgets = parse_floats(args.budgets, "--budgets")
    shapes = [parse_shape(s) for s in args.sizes.split(",") if s.strip()]
    runs, notes = write_sweep(
        args.out, args.base, budgets, shapes, args.set, args.min_steps, args.force
    )
    for note in notes:
        print(f"kiln scaling sweep: note: {note}")
    for r in runs:
        print(f"  {r.name:<22}{r.params:>12,} params {r.tokens:>14,} tokens {r.steps:>7,} steps")
    print(f"kiln scaling sweep: wrote {len(runs)} configs under {Path(args.out) / 'configs'}")
    if args.run:
        return run_run(argparse.Namespace(sweep=args.out, no_progress=args.no_progress))
    print(f"kiln scaling sweep: train them with: kiln scaling run {args.out}")
    return 0


def run_run(args: argparse.Namespace) -> int:
    """Train the sweep's unfinished runs."""
    from kiln.scaling.sweep import run_sweep

    rows = run_sweep(args.sweep, progress=not args.no_progress)
    print(f"kiln scaling run: {len(rows)} results in {Path(args.sweep) / 'results.csv'}")
    return 0


def run_fit(args: argparse.Namespace) -> int:
    """Fit, write fit.json and the PNGs, print the fitted numbers."""
    from kiln.io import check_can_write, write_json_atomic
    from kiln.scaling.fit import fit_all, read_points
    from kiln.scaling.plots import FIGURES, plot_all

    out = Path(args.out)
    for name in ("fit.json", *FIGURES):  # a previous fit's figures are results too
        check_can_write(out / name, args.force)
    points = [p for p in read_points(args.results) if p.c >= args.min_budget]
    if not points:
        raise KilnError(f"no run has a budget of at least --min-budget {args.min_budget:g}")
    if args.starts < 0:
        raise KilnError(f"--starts must be >= 0, got {args.starts}")
    extrapolated = "keep" if args.keep_extrapolated else "drop"
    report = fit_all(points, top_starts=args.starts or None, extrapolated=extrapolated)
    pngs = plot_all(points, report, out)  # first: without matplotlib, nothing is half-written
    write_json_atomic(out / "fit.json", report.to_dict())
    for p in report.parabolas:
        vertex = f"N_opt {p.n_opt:.3g}, loss {p.loss_opt:.4f}" if p.has_minimum else "no minimum"
        print(f"budget {p.budget:.3g}: {p.n_points} runs, {vertex}")
    if report.n_opt and report.d_opt:
        print(f"N_opt ∝ C^{report.n_opt.exponent:.3f}, D_opt ∝ C^{report.d_opt.exponent:.3f}")
    if report.parametric:
        law = report.parametric.law
        print(f"L(N, D) = {law.E:.3f} + {law.A:.4g}/N^{law.alpha:.3f} + {law.B:.4g}/D^"
              f"{law.beta:.3f}  (RMSE of log L {report.parametric.rmse_log:.4f}; "
              f"N_opt ∝ C^{law.a:.3f})")  # fmt: skip
    for note in report.notes:
        print(f"note: {note}")
    print(f"kiln scaling fit: wrote {out / 'fit.json'}, {', '.join(p.name for p in pngs)}")
    return 0


# ---- mup-check ---------------------------------------------------------------------------------


def run_mup_check(args: argparse.Namespace) -> int:
    """Coordinate check under SP and µP; a slope table (or JSON) and optionally the plot."""
    from kiln.io import check_can_write
    from kiln.scaling.mup_check import PARAMETERISATIONS, coord_check, format_checks, plot_checks

    try:
        widths = sorted({int(w) for w in args.widths.split(",")})
    except ValueError:
        raise KilnError(f"--widths must be comma-separated integers, got {args.widths!r}") from None
    if len(widths) < 2 or widths[0] < 4 or any(w % 4 for w in widths):
        raise KilnError(f"--widths needs two or more multiples of 4 (4 heads), got {args.widths!r}")
    if args.optimizer not in ("adamw", "muon"):
        raise KilnError(f"--optimizer must be adamw or muon, got {args.optimizer!r}")
    if args.steps < 1 or args.layers < 1 or args.lr <= 0:
        raise KilnError("--steps and --layers must be >= 1 and --lr > 0")
    if args.plot is not None:
        check_can_write(args.plot, args.force)
    checks = [
        coord_check(widths, p, steps=args.steps, lr=args.lr, optimizer=args.optimizer,
                    n_layer=args.layers)
        for p in PARAMETERISATIONS
    ]  # fmt: skip
    if args.json:
        doc = {c.parameterisation: {"widths": c.widths, "scales": c.scales, "slopes": c.slopes()}
               for c in checks}  # fmt: skip
        print(json.dumps(doc, indent=2))
    else:
        print(f"mean |activation| after {args.steps} {args.optimizer} steps at lr {args.lr}, "
              f"widths {widths} (µP base {widths[0]}); slope of log size vs log width:")  # fmt: skip
        print(format_checks(checks))
    if args.plot is not None:
        title = f"coordinate check: {args.steps} {args.optimizer} steps, lr {args.lr}"
        print(f"plot: {plot_checks(checks, args.plot, title)}")
    return 0
