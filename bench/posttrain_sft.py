"""Post-training benchmark: base vs full SFT vs LoRA from the `kiln demo` model, and the row layout.

The chain, each step a kiln command (what the README's "fine-tune" section shows):

1. the demo model: --demo RUN, else the newest runs/demo-*, else `kiln demo --minutes 3`;
2. `kiln posttrain add-chat-tokens DEMO OUT/demo-chat` and `kiln data chat OUT/chat`;
3. layouts: full SFT for --layout-steps steps with data.layout = packed, then padded (same
   config, seed and number of rows per step), and a side-by-side timing of one training step on
   a packed and a padded batch, alternated (--repeats times each), in this process: tokens/s
   counts conversation tokens (padding excluded); held-out loss is the mean loss per reply token
   over the held-out conversations, computed the same way for both models;
4. `kiln sft` full and LoRA (--budget of training each, 8 rows of 256 per step; full: lr 5e-4;
   LoRA: rank 8, alpha 16, all four linear layers of every block, lr 2e-3); trainable parameters and the optimizer state's bytes are read from the
   final checkpoints. Everything runs in configs/sft.toml's dtype "auto" (bf16 where the CPU
   has native bf16 matmuls, else fp32);
5. `kiln eval MODEL --chat-tasks OUT/chat --limit N` for base, SFT and LoRA: success per task on
   the first N held-out prompts of each task (greedy) and TinyStories-valid bits per byte.

Results go to OUT/results.json and a Markdown section on stdout (for bench/RESULTS.md).

    .venv/bin/python bench/posttrain_sft.py --demo runs/demo-20261201-110757   # ~25 min, 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._load import add_noisy_flag, begin  # noqa: E402
from kiln.io import write_json_atomic  # noqa: E402

CONFIG = ROOT / "configs" / "sft.toml"


def kiln(*args: str) -> None:
    """Run one kiln command (with this interpreter and this checkout), failing loudly."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    print("$ kiln " + " ".join(args), file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "kiln.cli", *args], check=True, env=env)


def find_demo(given: str | None, out: Path) -> Path:
    """The demo run to start from (trained briefly when there is none)."""
    if given:
        return Path(given)
    found = sorted(Path("runs").glob("demo-*"), key=lambda p: p.stat().st_mtime)
    if found:
        return found[-1]
    kiln("demo", "--minutes", "3", "--out", str(out / "demo"))
    return out / "demo"


def sft_args(base: Path, chat: Path, run: Path, *sets: str) -> list[str]:
    """`kiln sft` arguments for this benchmark's runs."""
    common = [
        f"sft.base={base}", f"data.train={chat / 'train.jsonl'}",
        f"data.val={chat / 'heldout.jsonl'}", f"logging.run_dir={run}", "eval.every=0",
        "checkpoint.every=0", *sets,
    ]  # fmt: skip
    return ["sft", str(CONFIG), *[a for s in common for a in ("--set", s)], "--no-progress"]


def last_metrics(run: Path) -> dict[str, Any]:
    """The final record of a run's metrics.jsonl."""
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])


def mean_tokens_per_s(run: Path) -> float:
    """Mean logged positions/s of a run (padding included), skipping the first record."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    values = [r["tokens_per_s"] for r in records[1:] if r.get("tokens_per_s")]
    return statistics.mean(values) if values else float("nan")


def heldout_loss(run: Path, chat: Path) -> float:
    """Mean loss per reply token of a run's model over the held-out conversations."""
    from kiln.loading import load_model
    from kiln.posttrain.sft.packing import build_rows
    from kiln.posttrain.sft.run import render_file, rows_loss

    loaded = load_model(run, device="cpu")  # dtype auto, as the runs trained
    assert loaded.tokenizer is not None
    rows = build_rows(render_file(chat / "heldout.jsonl", loaded.tokenizer), 256, "packed")
    with loaded.autocast():
        return rows_loss(loaded.model, rows)


def optimizer_bytes(run: Path) -> int:
    """Bytes of tensors in the latest checkpoint's optimizer state."""
    import torch

    from kiln.loading import find_checkpoint

    state = torch.load(find_checkpoint(run) / "optimizer.pt", weights_only=True)

    def size(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(size(v) for v in value.values())
        if isinstance(value, list | tuple):
            return sum(size(v) for v in value)
        return 0

    return sum(size(o["state"]) for o in state["optimizers"])


def trainable(run: Path) -> tuple[int, int]:
    """(trainable, total) parameters of a run, from its config and latest checkpoint."""
    from safetensors import safe_open

    from kiln.loading import find_checkpoint
    from kiln.model.config import ModelConfig

    path = find_checkpoint(run)
    state = json.loads((path / "state.json").read_text())
    total = ModelConfig.from_dict(dict(state["config"]["model"])).num_params()
    if not (state["config"].get("lora") or {}).get("rank"):
        return total, total
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = [k for k in f.keys() if ".lora_" in k]  # noqa: SIM118 (not a dict)
        shapes = [f.get_slice(k).get_shape() for k in names]
    n = sum(rows * cols for rows, cols in shapes)
    return n, total


def step_timing(base: Path, chat: Path, repeats: int) -> dict[str, float]:
    """Conversation tokens/s of one training step, packed vs padded, alternated in one process."""
    import torch

    from kiln.loading import load_model
    from kiln.posttrain.sft.packing import build_rows
    from kiln.posttrain.sft.run import render_file

    loaded = load_model(base, device="cpu")
    assert loaded.tokenizer is not None
    examples = render_file(chat / "train.jsonl", loaded.tokenizer)[:640]
    model = loaded.model.train()
    batches = {}
    for layout in ("packed", "padded"):
        rows = build_rows(examples, 256, layout)  # type: ignore[arg-type]
        extra = [] if rows.segments is None else [torch.from_numpy(rows.segments[:16])]
        args = [torch.from_numpy(rows.inputs[:16]), torch.from_numpy(rows.targets[:16]), *extra]
        batches[layout] = (args, int(rows.real[:16].sum()))
    times: dict[str, list[float]] = {"packed": [], "padded": []}
    for _ in range(repeats):
        for layout, (args, _) in batches.items():
            start = time.perf_counter()
            with loaded.autocast():
                loss = model(*args)
            loss.backward()
            times[layout].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    return {
        f"{layout}_real_tokens_per_s": batches[layout][1] / statistics.median(t)
        for layout, t in times.items()
    }


def evaluate(model: Path, chat: Path, out: Path, limit: int | None) -> dict[str, Any]:
    """`kiln eval MODEL --chat-tasks CHAT` results (chat tasks and bits per byte)."""
    result = out / f"eval-{model.name}.json"
    extra = ["--limit", str(limit)] if limit else []
    kiln("eval", str(model), "--chat-tasks", str(chat), "--out", str(result), "--force",
         "--no-progress", *extra)  # fmt: skip
    return json.loads(result.read_text())


def main() -> int:
    """Run the layout timing, SFT and LoRA, evaluate; write results.json, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo", help="the demo run to start from (default: newest runs/demo-*)")
    parser.add_argument("--out", default="out/posttrain_sft", help="work folder")
    parser.add_argument("--budget", default="6m", help="training time of each main SFT run")
    parser.add_argument("--layout-steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, default=20, help="held-out prompts per task (0: all)")
    add_noisy_flag(parser)
    args = parser.parse_args()
    measured = begin("bench/posttrain_sft.py", args.noisy)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    demo = find_demo(args.demo, out)
    base, chat = out / "demo-chat", out / "chat"
    if not base.exists():
        kiln("posttrain", "add-chat-tokens", str(demo), str(base))
    if not chat.exists():
        kiln("data", "chat", str(chat))
    results: dict[str, Any] = {"demo": str(demo)}

    layouts = {}
    for layout in ("packed", "padded"):
        run = out / f"layout-{layout}"
        if not (run / "checkpoints").exists():
            kiln(*sft_args(base, chat, run, f"data.layout={layout}", "train.time_budget=none",
                           f"train.max_steps={args.layout_steps}"))  # fmt: skip
        layouts[layout] = {
            "positions_per_s": mean_tokens_per_s(run),
            "train_loss": last_metrics(run)["loss"],
            "heldout_loss": heldout_loss(run, chat),
        }
    layouts["step_timing"] = step_timing(base, chat, args.repeats)
    results["layouts"] = layouts

    runs = {"base": base}
    for name, sets in (
        ("sft", ["lora.rank=0", "optim.lr=5e-4", "batch.global_tokens=2048"]),
        ("lora", ["lora.rank=8", "lora.alpha=16", "optim.lr=2e-3", "batch.global_tokens=2048"]),
    ):
        run = out / f"run-{name}"
        if not (run / "checkpoints").exists():
            kiln(*sft_args(base, chat, run, f"train.time_budget={args.budget}", *sets))
        n, total = trainable(run)
        results[name] = {
            "steps": last_metrics(run)["step"], "train_loss": last_metrics(run)["loss"],
            "trainable_params": n, "total_params": total, "optimizer_bytes": optimizer_bytes(run),
            "heldout_loss": heldout_loss(run, chat),
        }  # fmt: skip
        runs[name] = run
    results["base_heldout_loss"] = heldout_loss(base, chat)
    results["eval"] = {name: evaluate(path, chat, out, args.limit) for name, path in runs.items()}
    results = measured.stamp(results)
    write_json_atomic(out / "results.json", results)
    print(markdown(results))
    return 0


def markdown(r: dict[str, Any]) -> str:
    """The RESULTS.md section of a results document."""
    m = r["measured"]
    lines = [
        (f"**noisy** ({m['noisy_reason']}). " if m["noisy"] else "")
        + f"Machine: {m['cpu']}, {m['cores']} cores, Python {platform.python_version()}; "
        f"{m['started']} to {m['ended']}; load average "
        + " ".join(f"{x:.2f}" for x in m["loadavg_start"])
        + " at start, "
        + " ".join(f"{x:.2f}" for x in m["loadavg_end"])
        + " at end.",
        "",
        "| model | " + " | ".join(r["eval"]["base"]["chat_tasks"]["tasks"]) + " | all | "
        "TinyStories-valid bpb | held-out reply loss |",
    ]
    tasks = list(r["eval"]["base"]["chat_tasks"]["tasks"])
    lines.append("|---" * (len(tasks) + 4) + "|")
    for name in ("base", "sft", "lora"):
        doc = r["eval"][name]
        cells = []
        for t in [*tasks, "all"]:
            entry = doc["chat_tasks"]["all"] if t == "all" else doc["chat_tasks"]["tasks"][t]
            cells.append(f"{entry['successes']}/{entry['n']} ({entry['success_rate']:.0%})")
        loss = r["base_heldout_loss"] if name == "base" else r[name]["heldout_loss"]
        lines.append(
            f"| {name} | " + " | ".join(cells)
            + f" | {doc['bpb']['bits_per_byte']:.3f} | {loss:.3f} |"
        )  # fmt: skip
    lines += ["", "| run | steps | trainable params | optimizer state |", "|---|---|---|---|"]
    for name in ("sft", "lora"):
        x = r[name]
        lines.append(
            f"| {name} | {x['steps']} | {x['trainable_params']:,} of {x['total_params']:,} | "
            f"{x['optimizer_bytes'] / 2**20:.2f} MiB |"
        )
    lay, timing = r["layouts"], r["layouts"]["step_timing"]
    lines += [
        "",
        "| layout | logged positions/s (runs one after the other) | step timing, conversation "
        "tokens/s (alternated) | final train loss | held-out reply loss |",
        "|---|---|---|---|---|",
    ]
    for name in ("packed", "padded"):
        lines.append(
            f"| {name} | {lay[name]['positions_per_s']:,.0f} | "
            f"{timing[f'{name}_real_tokens_per_s']:,.0f} | {lay[name]['train_loss']:.3f} | "
            f"{lay[name]['heldout_loss']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
