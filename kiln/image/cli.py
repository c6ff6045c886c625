"""`kiln image data`: the procedural scene dataset, or a folder of pictures, as an image dataset.

(`kiln image train-vqvae` is added to this group by kiln/train/cli.py: training lives in
kiln.train, a layer above kiln.image.)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kiln.commands import add_command_group, add_subcommand

DATA_EXAMPLES = """examples:
  kiln image data --out data/scenes32                       # 8000 + 500 + 500 scenes, 32×32
  kiln image data --out data/scenes64 --size 64 --train 20000 --seed 1
  kiln image data --from my_pictures/ --out data/mine --size 64   # PNG/JPEG + captions.jsonl"""


def register(sub: Any) -> None:
    """Add the `image` command group with `kiln image data`."""
    commands = add_command_group(
        sub,
        "image",
        "image data and models: procedural scenes, your own pictures, the VQ-VAE",
        "Images: build an image dataset (procedural scenes or a folder), train a VQ-VAE.",
        "kiln image data --out data/scenes32",
    )
    p = add_subcommand(
        commands, "data", "build an image dataset: procedural scenes or a folder", DATA_EXAMPLES
    )
    p.description = (
        "Draw the procedural scene dataset (captions from a small grammar, ground truth kept;\n"
        "splits train, val and heldout: compositions never seen in training), or read a folder\n"
        'of PNG/JPEG pictures listed in its captions.jsonl ({"file": ..., "caption": ...}\n'
        "per line; each centre-cropped to a square and resized). Written whole or not at all."
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the dataset directory to write")
    p.add_argument("--from", dest="folder", metavar="FOLDER", help="a folder of your pictures")
    p.add_argument("--size", type=int, default=32, help="picture side: 32 or 64 for scenes")
    p.add_argument("--train", type=int, default=8000, help="scenes: training pictures")
    p.add_argument("--val", type=int, default=500, help="scenes: validation pictures")
    p.add_argument("--heldout", type=int, default=500, help="scenes: unseen-composition pictures")
    p.add_argument("--val-fraction", type=float, default=0.1, help="folder: share for val")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-images", type=int, default=4096, help="pictures per shard file")
    p.add_argument("--force", action="store_true", help="replace an existing image dataset")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_data)


def run_data(args: argparse.Namespace) -> int:
    """Build the dataset and print what it holds."""
    from kiln.image.dataset import ScenesSpec, build_folder, build_scenes

    if args.folder:
        manifest = build_folder(
            args.folder, args.out, args.size, args.val_fraction, args.seed, args.force,
            args.shard_images,
        )  # fmt: skip
    else:
        spec = ScenesSpec(args.size, args.train, args.val, args.heldout, args.seed,
                          args.shard_images)  # fmt: skip
        total = spec.train + spec.val + spec.heldout
        from tqdm import tqdm

        with tqdm(total=total, unit="img", disable=args.quiet, file=sys.stderr) as bar:
            manifest = build_scenes(args.out, spec, args.force, tick=lambda: bar.update())
    counts = ", ".join(f"{name} {s['images']:,}" for name, s in manifest["splits"].items())
    print(f"wrote {args.out}: {manifest['size']}×{manifest['size']} pictures: {counts}")
    return 0
