"""The quiet re-measurement: the benchmarks whose RESULTS.md rows were taken under load, in a row.

Each item runs the command that produced its RESULTS.md section, one after the other, after
waiting for the machine to be quiet (1-minute load average at most bench/_load.py's 1.5; the
previous item's own load takes a minute or so to decay). An item whose load never drops within
--max-wait is skipped and says so; each script also refuses by itself (bench/_load.py) unless
--noisy is passed through. Everything is logged under --work: quiet.log (what ran, when, the
load before it, its exit status), ITEM.log (its full output) and summary.json.

Estimated minutes are for 2 quiet cores, from the RESULTS.md text (the times it gives, scaled
down from the loads they were taken at); the plan prints them. The full list is well over 45
minutes, so --budget-minutes picks a subset: items in the order below, each at full settings if
it still fits, else at its reduced settings (where it has some that keep the comparison
meaningful), else skipped; --only / --skip choose by name.

    .venv/bin/python bench/quiet.py --plan                        # the plan and the total
    .venv/bin/python bench/quiet.py --budget-minutes 45           # what fits in 45 minutes
    .venv/bin/python bench/quiet.py --only serve,arch --demo runs/demo-20261201-152118
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._load import MAX_START_LOAD  # noqa: E402
from kiln.io import write_json_atomic  # noqa: E402

POLL_S = 10.0
# Start a little below the scripts' own threshold: starting Python and torch lifts the 1-minute
# average a bit before the script reads it.
QUIET_LOAD = MAX_START_LOAD - 0.25


@dataclasses.dataclass(frozen=True)
class Item:
    """One re-measurement: its command, estimated minutes, and reduced settings if any."""

    name: str
    section: str  # the RESULTS.md section it re-measures
    argv: tuple[str, ...]  # after the interpreter; {work}, {demo}, {sft}, {chat} filled in
    minutes: float
    reduced: tuple[str, ...] | None = None
    reduced_minutes: float | None = None
    reduced_note: str = ""
    needs: tuple[str, ...] = ()  # prerequisites: "demo", "sft"
    default: bool = True  # in the plan unless --only names the rest


POSTTRAIN = ("--pref-prompts", "900", "--samples", "4", "--max-new-tokens", "128",
             "--dpo-steps", "70", "--rl-steps", "100", "--rl-lr", "2e-5", "--group-size", "4",
             "--prompts-per-step", "4", "--limit", "50")  # fmt: skip

ITEMS: tuple[Item, ...] = (
    Item("serve", "Serving engine (kiln vs HF generate vs CTranslate2)",
         ("bench/serve.py", "--quick", "--rounds", "2", "--poisson-seconds", "8"), 6.0,
         ("bench/serve.py", "--quick", "--rounds", "2", "--poisson-seconds", "8",
          "--concurrency", "1,32"), 3.0,
         "1 and 32 requests only: the issue's targets are at 32; the 8/64 rows are dropped"),
    Item("serve32", "Serving engine, the 3-round run at 32 requests",
         ("bench/serve.py", "--concurrency", "32", "--rounds", "3", "--poisson-seconds", "0"),
         3.0),
    Item("serve_load", "Serving (`kiln serve` under load)",
         ("bench/serve_load.py", "{demo}", "--clients", "8", "--requests", "48",
          "--max-tokens", "64", "--rounds", "6", "--json", "{work}/serve_load.json"), 3.0,
         ("bench/serve_load.py", "{demo}", "--clients", "8", "--requests", "48",
          "--max-tokens", "64", "--rounds", "2", "--json", "{work}/serve_load.json"), 1.5,
         "2 alternating rounds: on a quiet machine the rounds no longer swing 5x",
         needs=("demo",)),
    Item("speedrun", "CPU speedrun: the record against the nanoGPT recipe, side by side",
         ("bench/speedrun.py", "--budget", "10m", "--baseline", "--valid",
          "--label", "quiet re-measurement (bench/quiet.py)"), 15.0),
    Item("posttrain_sft", "Post-training: SFT and LoRA",
         ("bench/posttrain_sft.py", "--demo", "{demo}", "--budget", "5m",
          "--out", "{work}/posttrain_sft"), 15.0,
         ("bench/posttrain_sft.py", "--demo", "{demo}", "--budget", "3m",
          "--out", "{work}/posttrain_sft"), 11.0,
         "3-minute fine-tunes: base vs SFT vs LoRA still side by side, on fewer steps",
         needs=("demo",)),
    Item("posttrain", "Post-training II: DPO, GRPO and PPO against SFT (three seeds)",
         ("bench/posttrain.py", "--sft", "{sft}", "--chat", "{chat}", "--out",
          "{work}/posttrain", "--seeds", "0", "1", "2", "--dpo-lr", "1e-5", *POSTTRAIN), 57.0,
         ("bench/posttrain.py", "--sft", "{sft}", "--chat", "{chat}", "--out",
          "{work}/posttrain", "--seeds", "0", "--dpo-lr", "1e-5", *POSTTRAIN), 19.0,
         "seed 0 only: each method against SFT on one seed; no spread over seeds, and GRPO's "
         "smallest gain (+0.9 points, seed 2) shows one seed cannot settle 'clearly above'",
         needs=("sft",)),
    Item("posttrain_dpo", "Post-training II: the DPO rerun at lr 2e-4 on the same pairs",
         ("bench/posttrain.py", "--sft", "{sft}", "--chat", "{chat}", "--out",
          "{work}/posttrain-dpo", "--seeds", "0", "1", "2", "--models", "dpo", "--dpo-lr", "2e-4",
          "--reuse-prefs", *POSTTRAIN), 9.0,
         ("bench/posttrain.py", "--sft", "{sft}", "--chat", "{chat}", "--out",
          "{work}/posttrain-dpo", "--seeds", "0", "--models", "dpo", "--dpo-lr", "2e-4",
          "--reuse-prefs", *POSTTRAIN), 3.0,
         "seed 0 only, as the reduced posttrain item", needs=("sft",)),
    Item("arch", "Architectures (MoE, MLA, sinks, RoPE scaling)",
         ("bench/arch.py", "--steps", "60", "--out-dir", "{work}/arch"), 8.0),
    Item("switches", "Architecture switches (equal tokens / equal time)",
         ("bench/switches.py", "--steps", "120", "--out-dir", "{work}/switches"), 10.0),
    Item("mup", "µP lr transfer", ("bench/mup.py", "--steps", "60", "--out-dir", "{work}/mup",
         "--plot", "{work}/mup_lr_transfer.png"), 8.0, default=False),
    Item("quantize", "Quantized weights",
         ("bench/quantize.py", "--model", "{demo}", "--hellaswag-limit", "500",
          "--out", "{work}/quantize.json"), 9.0, needs=("demo",), default=False),
    Item("model", "Model (kiln vs HF transformers, training and greedy decode)",
         ("bench/model.py",), 15.0, default=False),
)  # fmt: skip

# Prerequisites, made under --work when --demo / --sft and --chat are not given.
PREP_MINUTES = {"demo": 11.0, "sft": 8.0}
WAIT_MINUTES = 1.0  # per item: the previous one's load decaying below the threshold


@dataclasses.dataclass
class Step:
    """An item as planned: full or reduced, and its estimate including prerequisites."""

    item: Item
    reduced: bool
    minutes: float
    prep: tuple[str, ...]


def plan(names: list[str], budget: float | None, have: set[str]) -> tuple[list[Step], list[str]]:
    """The steps that fit the budget (full, else reduced) and the names skipped, with why."""
    steps: list[Step] = []
    skipped: list[str] = []
    used = 0.0
    made = set(have)
    for item in (i for i in ITEMS if i.name in names):
        prep = missing(item.needs, made)
        prep_min = sum(PREP_MINUTES[n] for n in prep) + WAIT_MINUTES * len(prep)
        options = [(False, item.minutes)]
        if item.reduced is not None and item.reduced_minutes is not None:
            options.append((True, item.reduced_minutes))
        for reduced, minutes in options:
            total = minutes + prep_min + WAIT_MINUTES
            if budget is None or used + total <= budget:
                steps.append(Step(item, reduced, total, prep))
                used += total
                made.update(prep)
                break
        else:
            skipped.append(f"{item.name} (needs {options[-1][1] + prep_min + WAIT_MINUTES:.0f} min, "
                           f"{budget - used:.0f} left)" if budget is not None else item.name)  # fmt: skip
    return steps, skipped


def missing(needs: tuple[str, ...], made: set[str]) -> tuple[str, ...]:
    """The prerequisites still to make, in order (the SFT model is made from the demo run)."""
    out: list[str] = []
    for name in needs:
        if name in made:
            continue
        if name == "sft" and "demo" not in made and "demo" not in out:
            out.append("demo")
        if name not in out:
            out.append(name)
    return tuple(out)


def fill(argv: tuple[str, ...], paths: dict[str, str]) -> list[str]:
    """The command line with {work}, {demo}, {sft}, {chat} filled in."""
    return [a.format(**paths) for a in argv]


class Log:
    """quiet.log: one timestamped line per event, also printed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, text: str) -> None:
        """Append a line (UTC time first) and print it."""
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC  {text}"
        print(line, flush=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")


def wait_quiet(log: Log, max_wait_s: float) -> tuple[float, float, float] | None:
    """Wait until the 1-minute load is at most QUIET_LOAD; the load, or None if it never was."""
    deadline = time.monotonic() + max_wait_s
    while True:
        load = os.getloadavg()
        if load[0] <= QUIET_LOAD:
            return load
        if time.monotonic() >= deadline:
            log(f"  load still {load[0]:.2f} after {max_wait_s / 60:.1f} min of waiting")
            return None
        time.sleep(POLL_S)


def run_logged(cmd: list[str], out: Path) -> int:
    """Run cmd with this checkout's kiln; its output to the terminal and to `out`; its status."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(out, "a", encoding="utf-8") as handle:
        handle.write(f"$ {shlex.join(cmd)}\n")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            handle.write(line)
        return proc.wait()


def prep_commands(name: str, paths: dict[str, str]) -> list[list[str]]:
    """The kiln commands that make a prerequisite under --work (RESULTS.md's own chain)."""
    kiln = [sys.executable, "-m", "kiln.cli"]
    w = paths["work"]
    if name == "demo":
        return [[*kiln, "demo", "--out", paths["demo"], "--force"]]
    return [
        [*kiln, "posttrain", "add-chat-tokens", paths["demo"], f"{w}/demo-chat", "--force"],
        [*kiln, "data", "chat", paths["chat"], "--force"],
        [*kiln, "sft", str(ROOT / "configs" / "sft.toml"), "--no-progress",
         "--set", f"sft.base={w}/demo-chat", "--set", f"data.train={paths['chat']}/train.jsonl",
         "--set", f"data.val={paths['chat']}/heldout.jsonl", "--set", "train.time_budget=6m",
         "--set", f"logging.run_dir={paths['sft']}"],
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Plan, then run each step after the machine is quiet; log everything under --work."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", type=Path, help="log and output folder (default /tmp/kiln-quiet-TIME)")
    p.add_argument("--budget-minutes", type=float, help="run only what fits (estimates)")
    p.add_argument("--only", help="comma-separated item names (any, also the non-default ones)")
    p.add_argument("--skip", default="", help="comma-separated item names to leave out")
    p.add_argument("--demo", help="a kiln demo run to use (else one is trained under --work)")
    p.add_argument("--sft", help="the SFT model for post-training II (with --chat)")
    p.add_argument("--chat", help="the `kiln data chat` folder for post-training II")
    p.add_argument("--max-wait", type=float, default=5.0, help="minutes to wait for quiet")
    p.add_argument("--noisy", action="store_true", help="run and record even when busy (marked)")
    p.add_argument("--plan", action="store_true", help="print the plan and the total; run nothing")
    args = p.parse_args(argv)
    known = {i.name for i in ITEMS}
    chosen = args.only.split(",") if args.only else [i.name for i in ITEMS if i.default]
    skip = {s for s in args.skip.split(",") if s}
    if bad := sorted((set(chosen) | skip) - known):
        p.error(f"--only/--skip: unknown item(s) {', '.join(bad)}; expected some of "
                f"{', '.join(i.name for i in ITEMS)}")  # fmt: skip
    if bool(args.sft) != bool(args.chat):
        p.error("--sft and --chat go together (the SFT model and its chat data)")
    work = args.work or Path(f"/tmp/kiln-quiet-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    paths = {"work": str(work), "demo": args.demo or str(work / "demo"),
             "sft": args.sft or str(work / "sft"), "chat": args.chat or str(work / "chat")}  # fmt: skip
    have = {n for n, given in (("demo", args.demo), ("sft", args.sft)) if given}
    steps, skipped = plan([n for n in chosen if n not in skip], args.budget_minutes, have)

    total = sum(s.minutes for s in steps)
    print(f"plan ({total:.0f} min estimated on 2 quiet cores, waits and prerequisites included):")
    for s in steps:
        argv_ = s.item.reduced if s.reduced else s.item.argv
        assert argv_ is not None
        note = f"  [reduced: {s.item.reduced_note}]" if s.reduced else ""
        prep = f" (first: make {' and '.join(s.prep)})" if s.prep else ""
        print(f"- {s.item.name}, {s.minutes:.0f} min{prep}: {shlex.join(fill(argv_, paths))}{note}")
    for name in skipped:
        print(f"- skipped: {name}")
    if args.plan:
        return 0

    work.mkdir(parents=True, exist_ok=True)
    log = Log(work / "quiet.log")
    log(f"bench/quiet.py {shlex.join(argv if argv is not None else sys.argv[1:])}; "
        f"{len(steps)} steps, {total:.0f} min estimated")  # fmt: skip
    results: list[dict[str, object]] = []
    failed = False
    broken: set[str] = set()  # prerequisites whose making failed: their items cannot run
    for s in steps:
        for name in s.prep:
            if run_step(f"prep-{name}", prep_commands(name, paths), work, log, args) != "ok":
                broken.add(name)
        blocked = set(s.item.needs) & broken or ("sft" in s.item.needs and "demo" in broken)
        if blocked:
            log(f"{s.item.name}: not run, its prerequisite failed")
        argv_ = s.item.reduced if s.reduced else s.item.argv
        assert argv_ is not None
        if s.item.name == "posttrain_dpo":
            link_prefs(work, log)
        cmd = [sys.executable, *fill(argv_, paths), *(["--noisy"] if args.noisy else [])]
        status = "prerequisite failed" if blocked else run_step(s.item.name, [cmd], work, log, args)
        results.append({"item": s.item.name, "section": s.item.section, "reduced": s.reduced,
                        "estimated_min": s.minutes, "status": status,
                        "log": str(work / f"{s.item.name}.log")})  # fmt: skip
        failed = failed or status != "ok"
        write_json_atomic(work / "summary.json", {"steps": results, "skipped": skipped})
    log(f"done: {sum(r['status'] == 'ok' for r in results)} of {len(results)} steps ok; "
        f"summary {work / 'summary.json'}")  # fmt: skip
    return 1 if failed else 0


def run_step(
    name: str, cmds: list[list[str]], work: Path, log: Log, args: argparse.Namespace
) -> str:
    """Wait for quiet, run the commands in turn: "ok", "not quiet" or "failed (exit N)"."""
    load = wait_quiet(log, args.max_wait * 60)
    if load is None and not args.noisy:
        log(f"{name}: skipped, the machine did not get quiet")
        return "not quiet"
    started = time.monotonic()
    log(f"{name}: start, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for cmd in cmds:
        code = run_logged(cmd, work / f"{name}.log")
        if code != 0:
            log(f"{name}: FAILED (exit {code}) after {(time.monotonic() - started) / 60:.1f} min: "
                f"{shlex.join(cmd)}; see {work / f'{name}.log'}")  # fmt: skip
            return f"failed (exit {code})"
    log(f"{name}: ok, {(time.monotonic() - started) / 60:.1f} min, load average now "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    return "ok"


def link_prefs(work: Path, log: Log) -> None:
    """Give the DPO rerun the first run's preference pairs (what --reuse-prefs reads)."""
    rerun = work / "posttrain-dpo"
    rerun.mkdir(parents=True, exist_ok=True)
    for prefs in sorted((work / "posttrain").glob("prefs-s*")):
        link = rerun / prefs.name
        if not link.exists():
            link.symlink_to(prefs.resolve(), target_is_directory=True)
            log(f"posttrain_dpo: reusing {prefs}")


if __name__ == "__main__":
    raise SystemExit(main())
