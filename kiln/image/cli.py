"""`kiln image data` (the procedural scenes, or a folder of pictures, as an image dataset) and
`kiln image sample` (draw captions with a trained DiT run).

(`kiln image train-vqvae`, `train-dit` and `train-checker` are added to this group by
kiln/train/cli.py: training lives in kiln.train, a layer above kiln.image.)
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
        "image data and models: scenes, your own pictures, the VQ-VAE, the DiT, sampling",
        "Images: build an image dataset, train a VQ-VAE, a DiT and its checker, draw captions.",
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
    _register_sample(commands)
    _register_tokens(commands)


SAMPLE_EXAMPLES = """examples:
  kiln image sample runs/dit32 --prompt "a red ball under a tree" -n 4 --out grid.png --seed 1
  kiln image sample runs/dit32 --prompt "a yellow sun in the sky" --steps 50 --guidance 4 \\
      --out sun.png --force
  kiln image sample runs/imgtok_32 --prompt "a red ball under a tree" --temperature 0.9 --out t.png"""


def _register_sample(commands: Any) -> None:
    p = add_subcommand(
        commands, "sample", "draw a caption with a trained image run", SAMPLE_EXAMPLES
    )
    p.description = (
        "Draw -n pictures of --prompt with a `kiln image train-dit` run, or a `kiln train` run\n"
        "on `kiln image tokens` shards (the token route: h·w codes sampled after <|image|>),\n"
        "and write them as one PNG grid (atomically). The same --seed draws the same pictures;\n"
        "picture i does not depend on -n."
    )
    p.add_argument("run", metavar="RUN", help="a DiT run or an image-token `kiln train` run")
    p.add_argument("--prompt", required=True, help="the caption to draw")
    p.add_argument("-n", type=int, default=4, help="how many pictures (default 4)")
    p.add_argument("--out", required=True, metavar="PNG", help="the grid picture to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--steps", type=int, help="sampling steps (default: the run's diffusion.sample_steps)"
    )
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale (1: none)")
    p.add_argument("--temperature", type=float, help="token route: sampling temperature (1)")
    p.add_argument("--top-k", type=int, help="token route: sample among the k likeliest codes")
    p.add_argument("--device", default="cpu")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_sample)


def run_sample(args: argparse.Namespace) -> int:
    """Draw the prompt and write the grid."""
    import time
    from pathlib import Path

    from kiln.errors import KilnError
    from kiln.image.sampler import load_image_model, save_grid

    if not 1 <= args.n <= 64:
        raise KilnError(f"-n must be in [1, 64], got {args.n}")
    if args.guidance is not None and args.guidance < 0:
        raise KilnError(f"--guidance must be >= 0, got {args.guidance}")
    out = Path(args.out)
    if out.suffix.lower() != ".png":
        raise KilnError(f"--out {out}: expected a .png file name")
    if out.exists() and not args.force:
        raise KilnError(f"{out} already exists; pass --force to replace it")
    model = load_image_model(args.run, args.device)
    model.caption_ids([args.prompt], "--prompt")  # a bad prompt named as the flag it came in
    from tqdm import tqdm

    tokens = getattr(model, "route", "") == "tokens"
    if not tokens and (args.temperature is not None or args.top_k is not None):
        raise KilnError("--temperature and --top-k are for a token-route run (kiln image tokens)")
    temperature = 1.0 if args.temperature is None else args.temperature
    knobs: dict = {"temperature": temperature, "top_k": args.top_k} if tokens else {}
    steps = args.steps or model.diffusion.sample_steps
    start = time.perf_counter()
    with tqdm(total=steps, unit="step", disable=args.quiet, file=sys.stderr) as bar:
        images = model.sample(
            [args.prompt] * args.n, args.seed, args.steps, guidance=args.guidance,
            on_step=lambda step, previews: bar.update(), **knobs,
        )  # fmt: skip
    seconds = time.perf_counter() - start
    save_grid(images, out)
    print(f"wrote {out}: {args.n} × {model.size}×{model.size}, {steps} steps, "
          f"{seconds / args.n:.2f} s a picture")  # fmt: skip
    return 0


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


TOKENS_EXAMPLES = """examples:
  kiln image tokens runs/vqvae32 data/scenes32 --out data/imgtok32
  kiln train configs/imgtok_32.toml          # kiln's Transformer on those shards, unchanged
  kiln image sample runs/imgtok_32 --prompt "a red ball under a tree" --out grid.png"""


def _register_tokens(commands: Any) -> None:
    p = add_subcommand(
        commands, "tokens", "image dataset -> token shards of captions and VQ codes",
        TOKENS_EXAMPLES,
    )  # fmt: skip
    p.description = (
        "Encode every picture of an image dataset with a trained VQ-VAE and write kiln token\n"
        "shards: per picture one document `caption tokens, <|image|>, h·w codes (raster order)`,\n"
        "padded with end-of-text to --doc-tokens. The tokenizer.json beside them is a BPE of the\n"
        "training captions plus <|image|> and <|code_k|> special tokens (layout recorded in its\n"
        "metadata); the VQ-VAE's weights are copied in. Train with `kiln train`, data.seq_len =\n"
        "the document length it prints."
    )
    p.add_argument("vqvae", metavar="RUN_VQVAE", help="a `kiln image train-vqvae` run folder")
    p.add_argument("data", metavar="DATA", help="an image dataset (from kiln image data)")
    p.add_argument("--out", required=True, metavar="SHARDS", help="the token dataset to write")
    p.add_argument("--vocab-size", type=int, default=384, help="caption BPE vocabulary (384)")
    p.add_argument("--doc-tokens", type=int, help="document length (default: the longest, to 8)")
    p.add_argument("--force", action="store_true", help="replace an existing token dataset")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_tokens)


def run_tokens(args: argparse.Namespace) -> int:
    """Write the token shards and say how to train on them."""
    from kiln.errors import KilnError
    from kiln.image.tokens import build_image_tokens

    if args.vocab_size < 257:
        raise KilnError(
            f"--vocab-size must be >= 257 (256 bytes + end-of-text), got {args.vocab_size}"
        )
    if args.doc_tokens is not None and args.doc_tokens < 4:
        raise KilnError(f"--doc-tokens must be >= 4, got {args.doc_tokens}")
    manifest = build_image_tokens(args.vqvae, args.data, args.out, args.vocab_size,
                                  args.doc_tokens, args.force, not args.quiet)  # fmt: skip
    layout = manifest.config["layout"]
    counts = ", ".join(f"{n} {s.documents:,}" for n, s in manifest.splits.items())
    print(f"wrote {args.out}: {counts} pictures as {layout['doc_tokens']}-token documents "
          f"({layout['grid']}×{layout['grid']} codes), vocabulary {manifest.tokenizer.vocab_size}; "
          f"train with data.seq_len={layout['doc_tokens']}")  # fmt: skip
    return 0
