"""`kiln demo`: the whole path on the embedded TinyStories corpus, on a CPU in minutes.

Tokenizer -> token shards -> a small Llama-style model -> validation loss -> three sampled
stories -> a report, all under one run folder.

Training is sized by time, not steps: the demo config's `train.time_budget` (10 minutes, or
`--minutes N`, which also picks the recipe made for the nearest budget: demo.toml for 10,
demo_60m.toml for 60; see `demo_recipe`) so the demo ends on time on a slow CPU and trains longer
on a fast one. The other
stages cost little beside it (measured on a 2-core machine shared with other jobs: tokenizer and
shards under a second each, model set-up under a second, a checkpoint under 0.2 s, the three
stories 6-15 s, the report ~1 s; a validation pass with its samples cost 1-10 steps of 16k
tokens in noisy measurements and comes every 400 steps of 2k tokens (as often), so 2-20% of the
budget, plus one at the end; the budget itself may run over by one step). That puts the whole demo at 11-13 minutes, under 15 on
any 2-core x86-64 machine. `--steps N` trains exactly N steps instead.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.errors import KilnError
from kiln.io import asset
from kiln.tokenizer.special import EOT

if TYPE_CHECKING:  # torch-heavy modules are imported inside the steps that need them
    from kiln.model import Transformer
    from kiln.tokenizer import Tokenizer
    from kiln.train.trainer import RunResult, Trainer

STORY_PROMPTS = ("Once upon a time", "One day, a little girl named Lily", "Tom and his dog")
DEMO_MARKER = ".kiln-demo"  # marks a folder `kiln demo --force` may replace
DEMO_ENTRIES = {DEMO_MARKER, "tokenizer.json", "data", "train", "report"}
DEMO_SAMPLE = "Once upon a time, a little robot named Kiln baked 3 loaves of bread. It's warm!"
# The prepared recipes by the training minutes they were made for (docs/speedrun.md).
RECIPES = {10.0: "demo.toml", 60.0: "demo_60m.toml"}


def demo_recipe(minutes: float | None) -> str:
    """The recipe for a budget: the one made for the nearest number of minutes, in ratio.

    10 minutes (or no --minutes) is demo.toml, 60 is demo_60m.toml; between them the switch is
    at their geometric mean, √600 ≈ 24.5 minutes. The run trains for the minutes given.
    """
    if minutes is None:
        return RECIPES[10.0]
    if not (math.isfinite(minutes) and minutes > 0):
        raise KilnError(f"--minutes must be a positive number, got {minutes}")
    made_for = min(RECIPES, key=lambda m: abs(math.log(minutes / m)))
    return RECIPES[made_for]


def _step(n: int, text: str) -> None:
    print(f"\n[{n}/5] {text}", flush=True)


def run_demo(args: argparse.Namespace) -> int:
    """Run the five stages and say where everything was written."""
    if args.image:
        from kiln.demo_image import run_image_demo

        return run_image_demo(args)
    if args.chat:
        from kiln.demo_chat import run_chat_demo

        return run_chat_demo(args)
    if args.resume:
        raise KilnError(
            "--resume continues a `kiln demo --chat` or `--image` run; the plain demo starts over"
        )
    out = Path(args.out) if args.out else Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    _check_arguments(args)
    _prepare_out(out, args.force)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    _step(1, f"training a {args.vocab_size:,}-token byte-level BPE tokenizer on TinyStories")
    t0 = time.perf_counter()
    tok = _train_tokenizer(out, args.vocab_size)
    timings["tokenizer_s"] = time.perf_counter() - t0

    _step(2, "tokenizing the stories into token shards (2% of stories held out for validation)")
    t0 = time.perf_counter()
    data_dir = _make_shards(out)
    timings["shards_s"] = time.perf_counter() - t0

    _step(3, "training a small Llama-style model on the CPU")
    t0 = time.perf_counter()
    trainer, result = _train_model(out, data_dir, args)
    timings["train_s"] = time.perf_counter() - t0

    _step(4, "sampling three stories")
    t0 = time.perf_counter()
    stories = _sample_stories(trainer.model, tok, args.story_tokens)
    timings["sample_s"] = time.perf_counter() - t0
    for prompt, story in stories:
        print(f"\n--- {prompt!r}\n{story}")

    _step(5, "writing the report")
    timings["total_s"] = time.perf_counter() - t_start
    report = _write_report(out, trainer, result, stories, timings)
    val = (
        "not measured (eval.batches = 0)"
        if result.val_loss is None
        else (f"{result.val_loss:.3f} nats/token")
    )
    print(f"\nvalidation loss   {val} after {result.step} steps ({result.tokens:,} tokens)")
    print(f"dtype             {trainer.precision.describe()}")
    print(f"time              {timings['total_s'] / 60:.1f} min")
    print(f"results           {report}")
    return 0


def _check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad arguments before anything is written or replaced."""
    if args.vocab_size < 257:
        raise KilnError(
            f"--vocab-size {args.vocab_size} is too small: it must be at least 257 "
            "(256 byte values + the end-of-text token)"
        )
    if args.steps is not None and args.steps < 1:
        raise KilnError(f"--steps must be >= 1, got {args.steps}")
    if args.story_tokens < 0:
        raise KilnError(f"--story-tokens must be >= 0, got {args.story_tokens}")
    from kiln.devices import resolve_device
    from kiln.train.config import load_train_config
    from kiln.train.trainer import accumulation_steps

    # A bad --minutes or --set fails here, with the overrides the run will use, and so do the
    # Trainer's own checks that need no data (a --force must not delete the old run first).
    cfg = load_train_config(asset(demo_recipe(args.minutes)), [*_length_overrides(args), *args.set])
    resolve_device(cfg.train.device)
    accumulation_steps(cfg.batch.global_tokens, 1, cfg.batch.micro_batch, cfg.data.seq_len)
    for i, prompt in enumerate(cfg.eval.sample_prompts):
        if EOT in prompt and not cfg.eval.allow_special:
            raise KilnError(
                f"eval.sample_prompts[{i}] {prompt!r} contains the special token {EOT!r}; "
                "set eval.allow_special = true to encode it as that control token, or remove it"
            )


# Every file an older demo (before the marker) wrote, as paths relative to its folder: its
# layout is accepted by --force only when it holds nothing else.
_DEMO_FILES = re.compile(
    r"tokenizer\.json"
    r"|data/(manifest\.json|[a-z]+_\d{6}\.(bin|idx))"
    r"|train/(config\.toml|metrics\.jsonl|samples\.jsonl|\.lock)"
    r"|train/checkpoints/(latest|step_\d+/(model\.safetensors|optimizer\.pt|state\.json))"
    r"|report/(summary\.json|loss\.png)"
)


def is_demo_dir(path: Path) -> bool:
    """Whether `path` is a run folder `kiln demo` made (the only kind --force replaces)."""
    if (path / DEMO_MARKER).is_file():
        return True
    # A folder of a kiln version before the marker: every file in it must be one a demo writes
    # (a user's corpus or weights beside them make it the user's), with a tokenizer and what
    # only a demo run makes (a tokenizer.json and data/ alone are any user's tokenizer work).
    if not {entry.name for entry in path.iterdir()} <= DEMO_ENTRIES:
        return False
    for root, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            relative = Path(root, name).relative_to(path).as_posix()
            if Path(root, name).is_symlink() or not _DEMO_FILES.fullmatch(relative):
                return False
    made_by_a_run = (path / "train" / "checkpoints").is_dir() or (
        path / "report" / "summary.json"
    ).is_file()
    return (path / "tokenizer.json").is_file() and made_by_a_run


def _prepare_out(out: Path, force: bool) -> None:
    """Create the run folder; with --force, first remove a previous demo run (nothing else)."""
    from kiln.folders import check_can_replace_dir, remove_dir

    if check_can_replace_dir(out, force, is_demo_dir, "a kiln demo run folder"):
        remove_dir(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KilnError(f"cannot create the run folder {out}: {exc.strerror}") from None
    (out / DEMO_MARKER).write_text(
        "made by `kiln demo`; `kiln demo --force` may replace this folder\n", encoding="utf-8"
    )


def _train_tokenizer(out: Path, vocab_size: int) -> Tokenizer:
    from kiln.tokenizer import train_bpe
    from kiln.tokenizer.train import format_report

    tok = train_bpe(
        [asset("tinystories_train.txt.gz")], vocab_size, [EOT], holdout=0.01, progress=True
    )
    tok.save(out / "tokenizer.json")
    print(format_report(tok.metadata["training"]))
    return tok


def _make_shards(out: Path) -> Path:
    from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards

    data_dir = out / "data"
    manifest = tokenize_to_shards(
        TokenizeConfig(
            tokenizer=str(out / "tokenizer.json"),
            inputs=(str(asset("tinystories_train.txt.gz")),),
            out=str(data_dir),
            val_fraction=0.02,
            progress=True,
        )
    )
    splits = {name: split.tokens for name, split in manifest.splits.items()}
    print("  " + ", ".join(f"{name}: {n:,} tokens" for name, n in splits.items()))
    return data_dir


def _train_model(out: Path, data_dir: Path, args: argparse.Namespace) -> tuple[Trainer, RunResult]:
    from kiln.train.config import load_train_config
    from kiln.train.trainer import Trainer

    overrides = [f"data.dataset={data_dir}", f"logging.run_dir={out / 'train'}"]
    overrides += _length_overrides(args)
    recipe = demo_recipe(args.minutes)
    cfg = load_train_config(asset(recipe), [*overrides, *args.set])
    print(f"  recipe kiln/assets/{recipe} (made for {_made_for(recipe):g} training minutes)")
    trainer = Trainer(cfg, out / "train")
    n_params = sum(p.numel() for p in trainer.model.parameters())
    length = (
        f"{cfg.train.max_steps} steps"
        if cfg.train.time_budget is None
        else f"{cfg.train.budget_seconds / 60:.1f} min of training (steps planned as it goes)"
    )
    print(
        f"  {n_params / 1e6:.1f}M parameters, {length}, {cfg.batch.global_tokens:,} tokens "
        f"per step ({trainer.precision.name}, {trainer.device})"
    )
    result = trainer.run()
    if result.interrupted:
        raise KilnError(
            "training was interrupted; resume with: "
            f"kiln train {out / 'train' / 'config.toml'} --resume"
        )
    if result.val_loss is None:
        result.val_loss = trainer.evaluate()
    return trainer, result


def _made_for(recipe: str) -> float:
    return next(m for m, name in RECIPES.items() if name == recipe)


def _length_overrides(args: argparse.Namespace) -> list[str]:
    """--steps N (exactly N steps, no budget) or --minutes N (the budget), else the config's."""
    demo_recipe(args.minutes)  # a bad --minutes is refused even beside --steps
    if args.steps is not None:
        return [f"train.max_steps={args.steps}", "train.time_budget=none"]
    if args.minutes is not None:
        if not (math.isfinite(args.minutes) and args.minutes > 0):
            raise KilnError(f"--minutes must be a positive number, got {args.minutes}")
        return [f"train.time_budget={args.minutes * 60:g}"]
    return []


def _sample_stories(model: Transformer, tok: Tokenizer, max_tokens: int) -> list[tuple[str, str]]:
    from kiln.model.generate import generate

    model.eval()
    prompts = [tok.encode(p) for p in STORY_PROMPTS]
    eot = tok.special_tokens[EOT]
    outputs = generate(
        model, prompts, max_tokens, temperature=0.8, top_k=50, seed=0, stop_tokens=[eot]
    )
    return [(p, p + tok.decode(ids)) for p, ids in zip(STORY_PROMPTS, outputs, strict=True)]


def _write_report(
    out: Path,
    trainer: Trainer,
    result: RunResult,
    stories: list[tuple[str, str]],
    timings: dict[str, float],
) -> Path:
    from kiln.io import write_json_atomic
    from kiln.train.report import plot_losses

    report_dir = out / "report"
    summary = {
        "val_loss": result.val_loss,
        "steps": result.step,
        "tokens": result.tokens,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "precision": trainer.precision.to_dict(),
        "time_budget_s": trainer.cfg.train.budget_seconds,
        "train_seconds": round(trainer.train_seconds, 1),  # what the budget counts
        "timings": {k: round(v, 1) for k, v in timings.items()},
        "stories": [{"prompt": p, "text": s} for p, s in stories],
    }
    write_json_atomic(report_dir / "summary.json", summary)
    try:
        png = plot_losses(out / "train" / "metrics.jsonl", report_dir / "loss.png")
        print(f"  loss curve        {png}")
    except KilnError as exc:
        print(f"  (no loss curve: {exc})")
    return report_dir


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kiln demo` to the CLI."""
    from kiln.commands import add_subcommand

    parser = add_subcommand(
        sub,
        "demo",
        "run the whole path on the embedded TinyStories corpus",
        "examples:\n  kiln demo --out runs/demo\n  kiln demo --minutes 2   # a quick look\n"
        "  kiln demo --minutes 60  # the 1-hour recipe (a wider model, µP lr, at most 5 epochs)\n"
        "  kiln demo --steps 20    # exactly 20 steps\n"
        "  kiln demo --chat        # on to a chat model: SFT, GRPO, success tables (30 min)\n"
        "  kiln demo --image       # scenes -> VQ-VAE -> DiT, scored by a checker (15 min)",
        description="Train a tokenizer on the embedded TinyStories corpus, tokenize it into "
        "shards, train a small Llama-style model on the CPU, report its validation loss and "
        "sample three stories; everything goes under one run folder.",
    )
    parser.add_argument("--vocab-size", type=int, default=4096, help="tokens (default 4096)")
    parser.add_argument(
        "--minutes",
        type=float,
        help="training time budget in minutes (default 10; evaluation, sampling and checkpoints "
        "not counted); it picks the recipe made for the nearest budget: demo.toml (10) below "
        "24.5 minutes, demo_60m.toml (60) above; with --chat or --image the whole chain's "
        "(default 30 / 15)",
    )
    parser.add_argument(
        "--steps", type=int, help="train exactly this many steps (no budget) of that recipe"
    )
    parser.add_argument("--story-tokens", type=int, default=160, help="tokens per story")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="train config override"
    )
    parser.add_argument("--out", help="run folder (default runs/demo-<timestamp>)")
    parser.add_argument("--force", action="store_true", help="replace a folder kiln demo made")
    from kiln.demo_chat import add_chat_arguments

    add_chat_arguments(parser)
    from kiln.demo_image import add_image_arguments

    add_image_arguments(parser)
    parser.set_defaults(handler=run_demo)
