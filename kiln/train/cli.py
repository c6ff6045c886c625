"""`kiln train CONFIG.toml [...]`, `kiln export RUN --hf DIR [...]` and `kiln plot RUN`."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import time
from pathlib import Path
from typing import Any

EXAMPLES = """examples:
  kiln train configs/tiny.toml --set data.dataset=data/stories
  kiln train kiln/assets/demo.toml --set optim.lr=1e-3 --set train.time_budget=30m
  kiln train kiln/assets/demo.toml --set train.time_budget=none --set train.max_steps=500
  kiln train kiln/assets/demo.toml --resume            # continue from runs/demo/checkpoints/latest
  kiln train kiln/assets/demo.toml --plot-schedule --set train.max_steps=250
                                                   # write runs/demo/report/lr_schedule.png"""


PLOT_EXAMPLES = """examples:
  kiln plot runs/demo             # runs/demo/report/{loss,lr,grad_norm,throughput}.png
  kiln plot runs/demo-*/train     # several runs (e.g. those of kiln demo)"""


def register(sub: Any) -> None:
    """Add `kiln train` to the top-level `kiln` parser."""
    from kiln.commands import add_subcommand

    p = add_subcommand(sub, "train", "train a language model from a TOML config", EXAMPLES)
    p.description = (
        "Train a Transformer LM on a token-shard dataset, as a TOML config describes.\n"
        "The run directory gets config.toml (fully resolved), metrics.jsonl and checkpoints/;\n"
        "Ctrl-C or SIGTERM saves a checkpoint before exiting (continue with --resume)."
    )
    add_run_arguments(p, "run config (see configs/)", "optim.lr=3e-4")
    p.add_argument(
        "--plot-schedule",
        action="store_true",
        help="write the learning-rate schedule as a PNG in the run's report/ and exit",
    )
    p.set_defaults(handler=run_train)
    _register_plot(sub)
    _register_image(sub)


def add_run_arguments(p: argparse.ArgumentParser, config_help: str, example: str) -> None:
    """CONFIG.toml, --set, --resume and --no-progress: what `kiln train` and `kiln sft` take."""
    p.add_argument("config", metavar="CONFIG.toml", help=config_help)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config value, e.g. --set {example} (repeatable)",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the run's latest checkpoint"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _register_plot(sub: Any) -> None:
    """Add `kiln plot RUN`."""
    from kiln.commands import add_subcommand

    p = add_subcommand(
        sub, "plot", "plot a run's metrics as PNG curves and an HTML report", PLOT_EXAMPLES
    )
    p.description = (
        "Read RUN/metrics.jsonl and write RUN/report/: loss.png (train and validation loss\n"
        "against tokens), lr.png, grad_norm.png, throughput.png, and index.html (the curves,\n"
        "the final metrics and the resolved config, in one self-contained page)."
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directory (with metrics.jsonl)")
    p.set_defaults(handler=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    """Plot each run and say where its report is."""
    from kiln.train.report import plot_run

    for run in args.runs:
        report = plot_run(run)
        names = ", ".join(p.name for p in report.pngs)
        print(f"kiln plot: wrote {names} and {report.html}")
    return 0


def load_run_config(args: argparse.Namespace, load: Any) -> tuple[Any, Path]:
    """The config `load(path, overrides)` reads (--set, --no-progress applied), its run folder."""
    from kiln.train.config import default_run_dir

    overrides = list(args.set)
    if args.no_progress:
        overrides.append("logging.progress=false")
    cfg = load(args.config, overrides)
    return cfg, default_run_dir(cfg, args.config)


def run_train(args: argparse.Namespace) -> int:
    """Load the config, then plot its schedule or train (resuming if asked)."""
    from kiln.train.config import load_train_config

    cfg, run_dir = load_run_config(args, load_train_config)
    if args.plot_schedule:
        from kiln.errors import KilnError
        from kiln.train.schedule import plot_schedule

        if cfg.train.max_steps is None:
            raise KilnError(
                "--plot-schedule needs train.max_steps: a train.time_budget run plans its steps "
                "from the step time it measures while training (add --set train.max_steps=N)"
            )

        out = plot_schedule(
            cfg.schedule, cfg.train.max_steps, cfg.optim.lr, run_dir / "report" / "lr_schedule.png"
        )
        print(f"kiln train: wrote the learning-rate schedule to {out}")
        return 0
    return train_and_report(cfg, run_dir, args)


def train_and_report(
    cfg: Any,
    run_dir: Any,
    args: argparse.Namespace,
    build: Any = None,
    command: str = "train",
    after: Any = None,
) -> int:
    """Build the trainer, report the setup, train, report the outcome.

    `kiln sft` comes through here too: `build(cfg, run_dir, resume)` makes its trainer, and
    `after(trainer, result)` writes what it adds to the run (a LoRA adapter).
    """
    from kiln.train.trainer import Trainer

    made_here = not Path(run_dir).exists() and os.environ.get("RANK", "0") == "0"
    try:
        trainer = (build or Trainer)(cfg, run_dir, resume=args.resume)
    except Exception:
        if made_here:
            remove_if_untouched(Path(run_dir))
        raise
    # Under torchrun every rank runs this; only the main one speaks.
    say = trainer.say
    m, c = trainer.model_cfg, trainer.cfg
    say(
        f"kiln train: {m.num_params():,} parameters ({m.n_layer} layers, width {m.n_embd}) on "
        f"{trainer.device}; {c.batch.global_tokens:,} tokens per step = {trainer.accum} × "
        f"{c.batch.micro_batch} × {c.data.seq_len} × {trainer.dist.world_size} rank(s); "
        f"{_length(c)}; run in {run_dir}"
    )
    if args.resume:
        say(f"kiln train: resuming at step {trainer.step:,} ({trainer.tokens:,} tokens seen)")
        for note in trainer.notes:
            say(f"kiln train: note: {note}")
    start = time.perf_counter()
    try:
        result = trainer.run()
    except Exception:  # e.g. a corrupt shard: a folder with nothing of the run in it goes
        if made_here:
            if (lock := getattr(trainer, "_run_lock", None)) is not None:
                lock.release()  # ours, let go before its folder is
            remove_if_untouched(Path(run_dir))
        raise
    elapsed = time.perf_counter() - start
    if after is not None:
        after(trainer, result)
    if result.interrupted:
        again = shlex.join(
            continue_command(command, [args.config, *_set_args(args.set), "--resume"])
        )
        say(f"kiln train: stopped at step {result.step:,}; saved {result.checkpoint}")
        say(f"kiln train: continue with: {again}")
        return 128 + (result.signal or signal.SIGINT)  # the shell's code for "killed by it"
    val = f", val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
    if result.losses:
        last = f"loss {result.losses[-1]:.4f}"
    else:
        last = f"nothing to do ({_end_reached(trainer)})"
    say(
        f"kiln train: step {result.step:,} ({result.tokens:,} tokens) in {elapsed:.1f} s: "
        f"{last}{val}; {_checkpoint_note(result, trainer)}; "
        f"metrics in {run_dir / 'metrics.jsonl'}"
    )
    return 0


# What a run folder holds before its first logged step or checkpoint.
_START_FILES = {".lock", "config.toml", "metrics.jsonl", "samples.jsonl", "checkpoints"}


def remove_if_untouched(run_dir: Path) -> bool:
    """Delete a run folder a failed start made when it holds nothing of the run: only the lock,
    the config and empty logs (no metrics, no checkpoint). Returns whether it was deleted."""
    from kiln.folders import remove_dir

    if not run_dir.is_dir() or run_dir.is_symlink():
        return False
    for entry in run_dir.iterdir():
        if entry.name not in _START_FILES or entry.is_symlink():
            return False
        if entry.name == "checkpoints":
            if not entry.is_dir() or any(entry.iterdir()):
                return False
        elif entry.name.endswith(".jsonl") and entry.stat().st_size > 0:
            return False
    remove_dir(run_dir)
    return True


def continue_command(command: str, argv: list[str], env: Any = None) -> list[str]:
    """The command line that continues this run: `kiln COMMAND ARGV`, or under torchrun (its
    environment says so) the same `torchrun ... -m kiln.cli COMMAND ARGV` shape it was run in."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env and "LOCAL_WORLD_SIZE" not in env:
        return ["kiln", command, *argv]
    local = env.get("LOCAL_WORLD_SIZE", "1")
    launcher = ["torchrun", "--nproc-per-node", local]
    world = env.get("WORLD_SIZE", local)
    if world.isdigit() and local.isdigit() and int(world) > int(local) > 0:
        launcher += ["--nnodes", str(int(world) // int(local))]  # plus the same rendezvous flags
    return [*launcher, "-m", "kiln.cli", command, *argv]


def _end_reached(trainer: Any) -> str:
    """Why a resumed run had no step left: its step count or its time budget."""
    if trainer.budget is None:
        return f"train.max_steps = {trainer.max_steps:,} already reached"
    from kiln.train.budget import format_seconds

    return (
        f"the time budget's plan of {trainer.max_steps:,} steps is done: "
        f"{format_seconds(trainer.train_seconds)} of {format_seconds(trainer.budget.seconds)} "
        "trained"
    )


def _length(cfg: Any) -> str:
    """How long the run is: its steps, or its time budget (and any step cap)."""
    if cfg.train.time_budget is None:
        return f"{cfg.train.max_steps:,} steps"
    from kiln.train.budget import format_seconds

    cap = f" (at most {cfg.train.max_steps:,} steps)" if cfg.train.max_steps else ""
    return f"a time budget of {format_seconds(cfg.train.budget_seconds)} of training{cap}"


def _checkpoint_note(result: Any, trainer: Any) -> str:
    """Which checkpoint holds the result: the one saved now, else the one resumed from."""
    from kiln.checkpoint_format import latest_checkpoint

    path = result.checkpoint or latest_checkpoint(trainer.checkpoints)
    return f"checkpoint {path}" if path is not None else "no checkpoint saved"


def _set_args(assignments: list[str]) -> list[str]:
    """The --set arguments again, to repeat them in the resume command."""
    return [part for a in assignments for part in ("--set", a)]


VQVAE_EXAMPLES = """examples:
  kiln image train-vqvae configs/vqvae_32.toml
  kiln image train-vqvae configs/vqvae_32.toml --set train.max_steps=300 --set run_dir=runs/vq
  kiln image train-vqvae configs/vqvae_32.toml --resume       # continue from its latest"""


def _register_image(sub: Any) -> None:
    """Add `kiln image train-vqvae`, `train-dit`, `train-checker` to the `kiln image` group."""
    from kiln.commands import add_subcommand, command_group

    if "image" not in sub.choices:  # a parser of kiln.train's commands alone (as in its tests)
        return
    p = add_subcommand(
        command_group(sub, "image"), "train-vqvae", "train a VQ-VAE on an image dataset",
        VQVAE_EXAMPLES,
    )  # fmt: skip
    p.description = (
        "Train the VQ-VAE of kiln.image on a dataset from `kiln image data`, as a TOML config\n"
        "describes. The run folder gets config.toml, metrics.jsonl (loss, perplexity, codes,\n"
        "PSNR on the eval splits), checkpoints/, eval.json and report/reconstructions.png."
    )
    add_run_arguments(p, "VQ-VAE run config (see configs/vqvae_32.toml)", "model.codebook_size=512")
    p.set_defaults(handler=run_train_vqvae)
    _register_image_models(command_group(sub, "image"))


def run_train_vqvae(args: argparse.Namespace) -> int:
    """Train (or resume) a VQ-VAE run and print its final evaluation."""
    from kiln.train.vqvae import VQVAERun, VQVAETrainConfig

    cfg = VQVAETrainConfig.load(args.config, args.set)
    run = VQVAERun(cfg, resume=args.resume)
    for note in run.notes:
        print(note)
    final = run.run(progress=not args.no_progress)
    split = run.eval_splits[-1] if run.eval_splits else cfg.data.train_split
    picture = run.reconstruction_grid(Path(cfg.run_dir) / "report" / "reconstructions.png", split)
    shown = ", ".join(f"{k} {v}" for k, v in final.items() if k != "step")
    print(f"step {final['step']}: {shown or 'no eval split'}; {picture}")
    return 0


DIT_EXAMPLES = """examples:
  kiln image train-dit configs/dit_32.toml              # needs the VQ-VAE run it names
  kiln image train-dit configs/dit_32.toml --set diffusion.objective=flow --set run_dir=runs/ditf
  kiln image train-dit configs/dit_32.toml --resume     # continue from its latest"""

CHECKER_EXAMPLES = """examples:
  kiln image train-checker configs/checker_32.toml
  kiln image train-checker configs/checker_32.toml --set train.max_steps=500 --resume"""


def _register_image_models(commands: Any) -> None:
    """Add `kiln image train-dit` and `kiln image train-checker`."""
    from kiln.commands import add_subcommand

    p = add_subcommand(
        commands, "train-dit", "train the diffusion transformer over a VQ-VAE's latents",
        DIT_EXAMPLES,
    )  # fmt: skip
    p.description = (
        "Train a text-conditioned diffusion transformer on the latents of a trained VQ-VAE\n"
        "(config key `vqvae`). The run folder gets config.toml, tokenizer.json (the caption\n"
        "BPE), metrics.jsonl, checkpoints/ (VQ-VAE included), eval.json, report/samples.png;\n"
        "draw with `kiln image sample RUN --prompt ...`."
    )
    add_run_arguments(p, "DiT run config (see configs/dit_32.toml)", "diffusion.objective=flow")
    p.set_defaults(handler=run_train_dit)
    p = add_subcommand(
        commands, "train-checker", "train the checker CNN on rendered scenes", CHECKER_EXAMPLES
    )
    p.description = (
        "Train the independent checker (objects, colours, box centres) on rendered scenes and\n"
        "their ground truth only; prints its per-attribute accuracy on the eval splits."
    )
    add_run_arguments(p, "checker run config (see configs/checker_32.toml)", "train.max_steps=500")
    p.set_defaults(handler=run_train_checker)


def run_train_dit(args: argparse.Namespace) -> int:
    """Train (or resume) a DiT run, draw held-out captions, print its final evaluation."""
    from kiln.image.sampler import load_image_model, save_grid
    from kiln.train.dit import DiTRun, DiTTrainConfig

    cfg = DiTTrainConfig.load(args.config, args.set)
    run = DiTRun(cfg, resume=args.resume)
    for note in run.notes:
        print(note)
    final = run.run(progress=not args.no_progress)
    split = run.eval_split or cfg.data.train_split
    captions = [r["caption"] for r in run.data.records(split)[:8]]
    images = load_image_model(cfg.run_dir).sample(captions, seed=0)
    picture = save_grid(images, Path(cfg.run_dir) / "report" / "samples.png")
    shown = ", ".join(f"{k} {v}" for k, v in final.items() if k != "step")
    print(f"step {final['step']}: {shown or 'no eval split'}; {picture}")
    return 0


def run_train_checker(args: argparse.Namespace) -> int:
    """Train (or resume) a checker run and print its accuracy on the eval splits."""
    from kiln.train.checker import CheckerRun, CheckerTrainConfig

    run = CheckerRun(CheckerTrainConfig.load(args.config, args.set), resume=args.resume)
    for note in run.notes:
        print(note)
    final = run.run(progress=not args.no_progress)
    shown = ", ".join(f"{k} {v}" for k, v in final.items() if k != "step")
    print(f"step {final['step']}: {shown or 'no eval split'}")
    return 0
