"""kiln's DiT against a diffusers anchor, same data, same CPU minutes, scored by one checker.

    python bench/image.py                      # full: 32×32, ~8 minutes on 2 cores
    python bench/image.py --tiny --noisy       # seconds: proves the path (the test runs this)

One run, side by side:
1. `kiln image data` scenes (8000 train, 500 held-out compositions).
2. The checker (kiln/image/checker.py), trained for --checker-steps on renders only: a second
   scene dataset (seed 1) with the held-out compositions included (a checker that never saw a
   yellow car cannot say a car is yellow), never the pictures it scores. Its per-attribute
   accuracy on the held-out renders of step 1 comes first: the scores mean what it means.
3. kiln: the VQ-VAE for --prep-minutes, then the DiT on its latents for --minutes.
4. The anchor: diffusers' UNet2DModel with DDPMScheduler, trained by the loop of diffusers'
   "train a diffusion model" tutorial (noise, random timesteps, `add_noise`, MSE on ε, AdamW) on
   the same pictures in pixel space, conditioned on the caption through a torch
   TransformerEncoder over the same tokenizer's ids, mean-pooled into the UNet's class
   embedding ("identity"), with the same caption dropout; for --minutes + --prep-minutes (the
   kiln side's VQ-VAE and DiT together). Sampled by DDIMScheduler with the same steps and
   guidance scale as kiln.
Both draw one picture per held-out caption; the checker scores them (object, colour, relation,
all) and a Fréchet distance on its penultimate features is taken against the held-out renders.
Also: CPU minutes, sampling seconds per picture, peak RSS growth while training, a grid PNG
(render | kiln | anchor per caption) and the ratios kiln / anchor.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

# Run as a script from a plain checkout too (this checkout's kiln, and bench._load).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin

FULL = {"train": 8000, "val": 200, "heldout": 500, "eval": 100, "minutes": 2.0, "prep": 1.0,
        "steps": 20, "checker_steps": 1000}  # fmt: skip
TINY = {"train": 48, "val": 8, "heldout": 16, "eval": 4, "minutes": 0.05, "prep": 0.03, "steps": 3,
        "checker_steps": 3}  # fmt: skip


class PeakRSS:
    """The largest resident set size seen (polled from /proc) while the block runs, in MiB."""

    def __enter__(self) -> PeakRSS:
        self.start = self._rss()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> float:
        text = Path("/proc/self/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024  # type: ignore[union-attr]

    @property
    def growth(self) -> float:
        """MiB above the RSS at the start of the block."""
        return self.peak - self.start


def _budget_loop(step, seconds: float) -> tuple[int, float, float]:
    """Call step() until `seconds` of wall time pass; (steps, wall s, CPU s of this process)."""
    wall, cpu, n = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - wall < seconds or n == 0:
        step()
        n += 1
    return n, time.perf_counter() - wall, time.process_time() - cpu


def prepare(work: Path, sizes: dict[str, Any], size: int) -> tuple[Path, Path]:
    """The scene dataset, and the checker's own (seed 1, held-out compositions included)."""
    from kiln.image.dataset import ScenesSpec, build_scenes

    scenes, checker = work / "scenes", work / "checker_scenes"
    n = sizes["train"]
    for out, spec in ((scenes, ScenesSpec(size, n, sizes["val"], sizes["heldout"], seed=0)),
                      (checker, ScenesSpec(size, n, 0, n // 2, seed=1))):  # fmt: skip
        if not (out / "manifest.json").is_file():
            build_scenes(out, spec)
    return scenes, checker


def train_checker(work: Path, scenes: Path, size: int, steps: int, tiny: bool) -> Any:
    """The checker for `steps` steps (a yardstick, not a contestant: steps, not minutes), on
    its own renders: seen and held-out compositions alike, other pictures than the scored ones."""
    from kiln.train.checker import CheckerRun, CheckerTrainConfig

    sets = [f"data.dataset={scenes}", f"run_dir={work / 'checker'}", "train.max_steps=100000",
            'train.extra_splits=["heldout"]', "data.eval_splits=[]",
            f"model.image_size={size}",
            "train.log_every=50", "train.eval_every=100000", "schedule.warmup_steps=20"]  # fmt: skip
    if tiny:
        sets += ["model.channels=8", "model.features=32", "train.batch_size=8"]
    sets.append(f"train.max_steps={steps}")
    run = CheckerRun(CheckerTrainConfig.load(None, sets))
    wall, cpu = time.perf_counter(), time.process_time()
    while run.step < steps:
        run.train_step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    run.save()
    run._lock.release()
    return run, {"steps": steps, "wall_s": wall, "cpu_s": cpu}


def train_kiln(
    work: Path, scenes: Path, size: int, vq_seconds: float, seconds: float, tiny: bool
) -> tuple[dict, Any]:
    """kiln's VQ-VAE for vq_seconds, then the DiT for `seconds`; the record and the DiT run."""
    from kiln.train.dit import DiTRun, DiTTrainConfig
    from kiln.train.vqvae import VQVAERun, VQVAETrainConfig

    vq_sets = [f"data.dataset={scenes}", f"run_dir={work / 'vqvae'}", f"model.image_size={size}",
               "model.hidden=32",
               "model.code_dim=8", "model.codebook_size=256", "train.batch_size=32",
               "optim.lr=2e-3", "train.max_steps=100000", "train.restart_every=50"]  # fmt: skip
    if tiny:
        vq_sets += ["model.hidden=8", "model.codebook_size=16", "train.batch_size=8"]
    with PeakRSS() as rss:
        vq = VQVAERun(VQVAETrainConfig.load(None, vq_sets))
        vq_steps, vq_wall, vq_cpu = _budget_loop(vq.train_step, vq_seconds)
        vq.save()
        vq._lock.release()
        sets = [f"data.dataset={scenes}", f"vqvae={work / 'vqvae'}", f"run_dir={work / 'dit'}",
                "train.max_steps=100000", "train.log_every=50", "schedule.warmup_steps=50",
                "optim.lr=1e-3", "train.batch_size=32"]  # fmt: skip
        if tiny:
            sets += ["model.width=32", "model.depth=1", "model.heads=2", "model.text_layers=1",
                     "train.batch_size=8"]  # fmt: skip
        dit = DiTRun(DiTTrainConfig.load(None, sets))
        steps, wall, cpu = _budget_loop(dit.train_step, seconds)
        dit.save()
        dit._lock.release()
    record = {"vq_steps": vq_steps, "steps": steps, "wall_s": vq_wall + wall,
              "cpu_s": vq_cpu + cpu, "peak_mib": rss.growth,
              "params": sum(p.numel() for p in dit.model.dit.parameters())}  # fmt: skip
    return record, dit


class CaptionEncoder(torch.nn.Module):
    """The anchor's caption encoder: embeddings, a torch TransformerEncoder, a mean, a projection."""

    def __init__(self, vocab: int, width: int, out: int) -> None:
        super().__init__()
        self.pad = vocab + 1
        self.embed = torch.nn.Embedding(vocab + 2, width)
        self.pos = torch.nn.Embedding(64, width)
        layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True, dropout=0)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.proj = torch.nn.Linear(width, out)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, L) ids -> (B, out)."""
        real = ids != self.pad
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        x = self.encoder(x, src_key_padding_mask=~real)
        return self.proj((x * real[..., None]).sum(1) / real.sum(1, keepdim=True))


def anchor_model(size: int, vocab: int, tiny: bool) -> tuple[Any, CaptionEncoder]:
    """diffusers' UNet2DModel (caption through its identity class embedding) and its encoder."""
    from diffusers import UNet2DModel

    channels = (16, 32, 32) if tiny else (32, 64, 128)
    unet = UNet2DModel(
        sample_size=size, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=channels, norm_num_groups=8, class_embed_type="identity",
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
    )  # fmt: skip
    return unet, CaptionEncoder(vocab, 64, channels[0] * 4)


def train_anchor(work: Path, scenes: Path, seconds: float, tiny: bool, dit: Any) -> dict:
    """The diffusers tutorial's loop on the pictures for `seconds`."""
    from diffusers import DDPMScheduler

    from kiln.image.dataset import ImageDataset
    from kiln.image.vqvae import to_unit

    data = ImageDataset.open(scenes)
    images = data.images("train")
    ids = dit.ids.cpu()
    torch.manual_seed(0)
    unet, text = anchor_model(data.size, dit.cfg.model.vocab_size, tiny)
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    params = [*unet.parameters(), *text.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3 if not tiny else 2e-3)
    batch = 8 if tiny else 32
    rng = np.random.default_rng(0)

    def step() -> None:
        idx = np.sort(rng.choice(len(images), batch, replace=False))
        clean = to_unit(torch.from_numpy(np.array(images[idx])))
        caption = ids[idx].clone()
        drop = torch.rand(batch) < dit.cfg.model.caption_dropout
        caption[drop, 1:] = text.pad
        noise = torch.randn_like(clean)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (batch,))
        noisy = scheduler.add_noise(clean, noise, t)
        pred = unet(noisy, t, class_labels=text(caption)).sample
        loss = F.mse_loss(pred, noise)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    with PeakRSS() as rss:
        steps, wall, cpu = _budget_loop(step, seconds)
    return {"model": (unet.eval(), text.eval(), scheduler.config), "steps": steps, "wall_s": wall, "cpu_s": cpu,
            "peak_mib": rss.growth, "params": sum(p.numel() for p in unet.parameters())}  # fmt: skip


@torch.no_grad()
def sample_anchor(model: tuple, ids: torch.Tensor, steps: int, guidance: float, seed: int):
    """Pictures (N, 3, S, S) in [0, 1] by DDIM with classifier-free guidance."""
    from diffusers import DDIMScheduler

    unet, text, trained_with = model
    scheduler = DDIMScheduler.from_config(trained_with)  # the DDPM training schedule's betas
    scheduler.set_timesteps(steps)
    g = torch.Generator().manual_seed(seed)
    size = unet.config.sample_size
    x = torch.randn((len(ids), 3, size, size), generator=g)
    empty = torch.full_like(ids, text.pad)
    empty[:, 0] = ids[:, 0]
    cond = text(torch.cat([ids, empty]))
    for t in scheduler.timesteps:
        out = unet(torch.cat([x, x]), t, class_labels=cond).sample
        c, u = out.chunk(2)
        x = scheduler.step(u + guidance * (c - u), t, x).prev_sample
    return ((x.clamp(-1, 1) + 1) / 2).cpu()


def evaluate(checker: Any, images01: torch.Tensor, records: list, reference: torch.Tensor) -> dict:
    """Per-attribute accuracy and the Fréchet distance of pictures in [0, 1]."""
    from kiln.image.checker import frechet_distance, predict, score

    out = predict(checker, images01 * 2 - 1)
    return {**score(out, records), "frechet": frechet_distance(out["features"], reference)}


def write_grid(path: Path, columns: list[torch.Tensor], scale: int = 3) -> None:
    """One row per caption: render | kiln | anchor."""
    from kiln.image.sampler import save_grid

    rows = torch.stack(columns, dim=1).flatten(0, 1)  # (N·3, 3, S, S)
    save_grid(rows, path, columns=len(columns), scale=scale)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole comparison; returns the record."""
    from kiln.image.checker import predict, score
    from kiln.image.dataset import ImageDataset
    from kiln.image.sampler import load_image_model
    from kiln.image.vqvae import to_unit

    sizes = dict(TINY if args.tiny else FULL)
    minutes = args.minutes if args.minutes is not None else sizes["minutes"]
    prep = args.prep_minutes if args.prep_minutes is not None else sizes["prep"]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    scenes, checker_scenes = prepare(work, sizes, args.size)
    data = ImageDataset.open(scenes)
    checker_steps = args.checker_steps or sizes["checker_steps"]
    checker_run, checker_time = train_checker(
        work, checker_scenes, args.size, checker_steps, args.tiny
    )
    checker = checker_run.model.eval()
    held = data.records("heldout")
    renders = to_unit(torch.from_numpy(np.array(data.images("heldout"))))
    real = predict(checker, renders)
    checker_acc = score(real, held)
    print(f"checker on {len(held)} held-out renders: {checker_acc}", file=sys.stderr)
    kiln, dit = train_kiln(work, scenes, args.size, prep * 60, minutes * 60, args.tiny)
    anchor = train_anchor(work, scenes, (minutes + prep) * 60, args.tiny, dit)
    records = held[: sizes["eval"]]
    captions = [r["caption"] for r in records]
    model = load_image_model(work / "dit")
    steps, guidance = args.steps or sizes["steps"], model.diffusion.guidance
    start = time.perf_counter()
    kiln_images = torch.cat([model.sample(captions[i : i + 50], seed=i, steps=steps)
                             for i in range(0, len(captions), 50)])  # fmt: skip
    kiln["sample_s"] = (time.perf_counter() - start) / len(captions)
    ids = model.caption_ids(captions).cpu()
    start = time.perf_counter()
    anchor_images = torch.cat([sample_anchor(anchor["model"], ids[i : i + 50], steps, guidance, i)
                               for i in range(0, len(captions), 50)])  # fmt: skip
    anchor["sample_s"] = (time.perf_counter() - start) / len(captions)
    reference = real["features"]
    kiln.update(evaluate(checker, kiln_images, records, reference))
    anchor.update(evaluate(checker, anchor_images, records, reference))
    anchor.pop("model")
    render01 = (renders[: len(records)] + 1) / 2
    ref_fd = evaluate(checker, render01, records, reference)["frechet"]
    grid = Path(args.grid) if args.grid else work / "image_grid.png"
    write_grid(grid, [render01[:8], kiln_images[:8], anchor_images[:8]])
    return {
        "size": args.size, "train_images": sizes["train"], "eval_captions": len(records),
        "sample_steps": steps, "guidance": guidance, "minutes": minutes, "prep_minutes": prep,
        "checker": {**checker_acc, **checker_time, "renders_frechet": ref_fd},
        "kiln": kiln, "anchor": anchor, "grid": str(grid),
        "total_s": time.perf_counter() - t0,
    }  # fmt: skip


def table(doc: dict[str, Any]) -> str:
    """The markdown table of the record."""
    c, k, a = doc["checker"], doc["kiln"], doc["anchor"]
    lines = [
        f"checker on held-out renders: object {c['object']:.3f}, colour {c['colour']:.3f}, "
        f"relation {c['relation']:.3f}, all {c['all']:.3f} (Fréchet of renders to renders "
        f"{c['renders_frechet']:.2f})",
        "",
        "| model | object | colour | relation | all | Fréchet | CPU min | train steps | "
        "s / picture | peak RSS MiB | params |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in (("kiln DiT (+VQ-VAE)", k), ("diffusers UNet2DModel", a)):
        lines.append(
            f"| {name} | {r['object']:.3f} | {r['colour']:.3f} | {r['relation']:.3f} | "
            f"{r['all']:.3f} | {r['frechet']:.2f} | {r['cpu_s'] / 60:.1f} | {r['steps']} | "
            f"{r['sample_s']:.3f} | {r['peak_mib']:.0f} | {r['params']:,} |"
        )
    ratios = ", ".join(f"{m} {k[m] / a[m]:.2f}×" for m in ("object", "colour", "relation", "all")
                       if a[m] > 0)  # fmt: skip
    lines.append("")
    lines.append(f"kiln / anchor: {ratios}; Fréchet {k['frechet'] / max(a['frechet'], 1e-9):.2f}× "
                 f"(lower is better); sampling time {k['sample_s'] / a['sample_s']:.2f}×")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run both, print the table and the JSON record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="seconds, tiny models (a smoke run)")
    parser.add_argument("--size", type=int, default=32, choices=(32, 64))
    parser.add_argument("--minutes", type=float, help="kiln DiT training minutes (full: 2)")
    parser.add_argument("--steps", type=int, help="sampling steps for both (full: 20)")
    parser.add_argument("--prep-minutes", type=float, help="kiln's VQ-VAE minutes (full: 1)")
    parser.add_argument("--checker-steps", type=int, help="checker training steps (full: 1000)")
    parser.add_argument("--work", help="folder for data and runs (default: a new temporary one)")
    parser.add_argument("--grid", help="where to write the grid PNG (default WORK/image_grid.png)")
    parser.add_argument("--out", help="also write the JSON record here")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    add_noisy_flag(parser)
    args = parser.parse_args(argv)
    measured = begin("bench/image.py", args.noisy)
    if args.work is None:
        import tempfile

        args.work = tempfile.mkdtemp(prefix="kiln-bench-image-")
    work = Path(args.work)
    if work.exists() and any((work / n).exists() for n in ("checker", "vqvae", "dit")):
        sys.exit(f"bench/image.py: {work} holds runs of an earlier bench; give another --work")
    doc = measured.stamp(run(args))
    print(table(doc))
    print(measured.line())
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        from kiln.io import write_json_atomic

        write_json_atomic(args.out, doc)


if __name__ == "__main__":
    main()
