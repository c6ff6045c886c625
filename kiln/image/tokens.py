"""Images as tokens: `caption tokens, <|image|>, VQ codes` documents in kiln token shards.

`kiln image tokens RUN_VQVAE DATA --out SHARDS` encodes every picture of an image dataset with a
trained VQ-VAE and writes one document per picture: the caption's BPE tokens, `<|image|>`, the
h·w code ids in raster order (row by row, left to right), then end-of-text padding up to a fixed
length. Fixed-length documents line up with the loader's windows when `data.seq_len` equals that
length, so every training window is one whole picture, caption first.

The ids: the caption BPE's vocabulary (end-of-text included) comes first, `<|image|>` next, then
code k as `<|code_k|>`, a contiguous range. `<|image|>` and the codes are special tokens of the
dataset's tokenizer.json (caption text never encodes to them), and the layout is recorded in its
metadata under `image_tokens`, so a trained run's tokenizer says how to read its output. The
dataset folder also keeps the VQ-VAE's weights (vqvae.safetensors) that decode the codes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln import __version__
from kiln.data.manifest import (
    Manifest,
    SourceEntry,
    TokenizerEntry,
    creation_time,
    is_shard_dataset,
)
from kiln.data.shard_format import dtype_for_vocab, dtype_name
from kiln.data.shard_writer import ShardWriter
from kiln.data.tokenize_shards import install_dataset, remove_abandoned_builds
from kiln.errors import KilnError, not_found
from kiln.image.captions import EOT, train_caption_tokenizer
from kiln.image.dataset import ImageDataset
from kiln.image.vqvae import VQVAE, VQVAEConfig, to_unit
from kiln.io import sha256_file
from kiln.tokenizer import Tokenizer

IMAGE = "<|image|>"
LAYOUT_KEY = "image_tokens"  # the tokenizer metadata key that holds the layout
VQVAE_FILE = "vqvae.safetensors"
KIND = "image-tokens"  # manifest config `kind`


def code_token(k: int) -> str:
    """The special-token text of VQ code k."""
    return f"<|code_{k}|>"


@dataclass(frozen=True)
class TokenLayout:
    """Where the image tokens sit in the vocabulary and how long each document is."""

    text_vocab: int  # ids below this are the caption BPE's (end-of-text included)
    image_id: int
    code_base: int  # code k has id code_base + k
    codebook_size: int
    grid: int  # codes per side: grid² per picture
    doc_tokens: int  # every document's length, end-of-text padding included
    eot_id: int
    image_size: int

    @property
    def codes_per_image(self) -> int:
        """h·w: the codes that make one picture."""
        return self.grid * self.grid

    @property
    def max_caption_tokens(self) -> int:
        """The longest caption a document has room for."""
        return self.doc_tokens - self.codes_per_image - 2

    def document(self, caption: Sequence[int], codes: np.ndarray) -> np.ndarray:
        """One document: caption ids, <|image|>, code ids in raster order, end-of-text padding."""
        if len(caption) > self.max_caption_tokens:
            raise KilnError(
                f"a caption of {len(caption)} tokens does not fit documents of {self.doc_tokens}"
            )
        doc = np.full(self.doc_tokens, self.eot_id, dtype=np.int64)
        doc[: len(caption)] = caption
        doc[len(caption)] = self.image_id
        start = len(caption) + 1
        doc[start : start + self.codes_per_image] = self.code_base + codes.reshape(-1)
        return doc

    def read_document(self, doc: np.ndarray) -> tuple[list[int], np.ndarray]:
        """The caption ids and the (grid, grid) codes of a document `document` wrote."""
        where = np.flatnonzero(doc == self.image_id)
        if where.size != 1:
            raise KilnError(f"a document holds {where.size} {IMAGE} tokens, expected 1")
        start = int(where[0]) + 1
        codes = doc[start : start + self.codes_per_image].astype(np.int64) - self.code_base
        if (
            codes.size != self.codes_per_image
            or not ((codes >= 0) & (codes < self.codebook_size)).all()
        ):
            raise KilnError(
                f"a document's {self.codes_per_image} codes after {IMAGE} are not all codes"
            )
        return [int(t) for t in doc[: start - 1]], codes.reshape(self.grid, self.grid)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the tokenizer metadata and the manifest hold it)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> TokenLayout:
        """Read back `to_dict`'s output; a missing or odd field names `where`."""
        try:
            return cls(**{k: int(data[k]) for k in cls.__dataclass_fields__})
        except (KeyError, TypeError, ValueError) as exc:
            raise KilnError(f"{where}: malformed {LAYOUT_KEY} layout ({exc!r})") from None


def image_tokenizer(text: Tokenizer, layout: TokenLayout, extra: dict[str, Any]) -> Tokenizer:
    """The caption BPE plus `<|image|>` and the code tokens, the layout in its metadata."""
    specials = dict(text.special_tokens)
    specials[IMAGE] = layout.image_id
    for k in range(layout.codebook_size):
        specials[code_token(k)] = layout.code_base + k
    metadata = {**text.metadata, LAYOUT_KEY: {**layout.to_dict(), **extra}}
    return Tokenizer(text.vocab, text.merges, specials, text.pattern, metadata=metadata)


def latest_step(run: Path, what: str) -> Path:
    """The checkpoint directory `checkpoints/latest` of a run names (the on-disk layout)."""
    if not run.is_dir():
        raise not_found(run, what)
    pointer = run / "checkpoints" / "latest"
    if not pointer.is_file():
        raise KilnError(f"{run}: no checkpoints/latest; is it a trained {what}?")
    return run / "checkpoints" / pointer.read_text(encoding="utf-8").strip()


def read_state(step: Path) -> dict[str, Any]:
    """A checkpoint's state.json."""
    try:
        return json.loads((step / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KilnError(f"{step / 'state.json'}: unreadable ({exc})") from None


def vq_config(data: dict[str, Any]) -> VQVAEConfig:
    """A VQVAEConfig from a config dict (unknown keys ignored)."""
    names = set(VQVAEConfig.__dataclass_fields__)
    return VQVAEConfig(**{k: v for k, v in data.items() if k in names})


def load_vqvae_run(run: str | os.PathLike[str]) -> tuple[VQVAE, Path]:
    """The VQ-VAE of a `kiln image train-vqvae` run (eval mode) and its weights file."""
    from safetensors.torch import load_file

    step = latest_step(Path(run), "VQ-VAE run")
    config = read_state(step).get("config", {})
    model_cfg = config.get("model", {})
    if "codebook_size" not in model_cfg or "vq_model" in config:  # a DiT run holds one too
        raise KilnError(f"{run}: not a VQ-VAE run (train one with `kiln image train-vqvae`)")
    vq = VQVAE(vq_config(model_cfg))
    weights = step / "model.safetensors"
    vq.load_state_dict(load_file(weights))
    return vq.eval(), weights


@torch.no_grad()
def encode_split(vq: VQVAE, images: np.ndarray, batch: int = 256, tick: Any = None) -> np.ndarray:
    """(N, grid, grid) int64 codes of uint8 pictures (N, S, S, 3)."""
    out = []
    for start in range(0, len(images), batch):
        chunk = to_unit(torch.from_numpy(np.array(images[start : start + batch])))
        out.append(vq.encode(chunk).numpy().astype(np.int64))
        if tick is not None:
            tick(len(chunk))
    return np.concatenate(out) if out else np.zeros((0, 1, 1), dtype=np.int64)


def build_image_tokens(
    vq_run: str | os.PathLike[str], data_dir: str | os.PathLike[str], out: str | os.PathLike[str],
    vocab_size: int = 384, doc_tokens: int | None = None, force: bool = False,
    progress: bool = True,
) -> Manifest:  # fmt: skip
    """Write the token-shard dataset of `data_dir`'s pictures through `vq_run`'s codes."""
    from tqdm import tqdm

    out = Path(out)
    remove_abandoned_builds(out)
    if out.exists() and not force:
        raise KilnError(f"{out} already exists; pass --force to replace it")
    if out.exists() and any(out.iterdir()) and not is_shard_dataset(out):
        raise KilnError(
            f"{out} exists and is not a kiln token-shard dataset; refusing to replace it"
        )
    data = ImageDataset.open(data_dir)
    vq, vq_weights = load_vqvae_run(vq_run)
    if vq.config.image_size != data.size:
        raise KilnError(
            f"{vq_run}: the VQ-VAE takes {vq.config.image_size}×{vq.config.image_size} pictures, "
            f"{data_dir} holds {data.size}×{data.size}"
        )
    if "train" not in data.splits:
        raise KilnError(f"{data_dir}: no train split to train the caption tokenizer on")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(
        tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=".tmp", dir=out.parent)
    )
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the dataset gets a plain mkdir's mode
    writers: list[ShardWriter] = []
    try:
        captions = {s: [r["caption"] for r in data.records(s)] for s in data.splits}
        text = train_caption_tokenizer(captions["train"], vocab_size, tmp / "captions.json")
        (tmp / "captions.json").unlink()
        ids = {s: [text.encode(c) for c in caps] for s, caps in captions.items()}
        longest = max(len(i) for split in ids.values() for i in split)
        grid = vq.config.latent_size
        need = longest + 2 + grid * grid
        doc_len = doc_tokens or -(-need // 8) * 8
        if doc_len < need:
            raise KilnError(f"--doc-tokens {doc_len}: the longest caption needs {need} tokens")
        base = text.n_vocab
        layout = TokenLayout(base, base, base + 1, vq.config.codebook_size, grid, doc_len,
                             text.special_tokens[EOT], data.size)  # fmt: skip
        tok = image_tokenizer(text, layout, {"vqvae": VQVAE_FILE})
        tok.save(tmp / "tokenizer.json")
        shutil.copyfile(vq_weights, tmp / VQVAE_FILE)
        dtype = dtype_for_vocab(tok.n_vocab)
        total = sum(len(c) for c in captions.values())
        splits = {}
        with tqdm(total=total, unit="img", desc="encode", disable=not progress,
                  file=sys.stderr) as bar:  # fmt: skip
            for split in data.splits:
                codes = encode_split(vq, data.images(split), tick=bar.update)
                writer = ShardWriter(tmp, split, dtype, 100_000_000)
                writers.append(writer)
                for caption, grid_codes in zip(ids[split], codes, strict=True):
                    writer.add(layout.document(caption, grid_codes), 0)
                splits[split] = writer.close()
        entry = TokenizerEntry(str(out.resolve() / "tokenizer.json"),
                               sha256_file(tmp / "tokenizer.json"), tok.n_vocab, EOT,
                               layout.eot_id)  # fmt: skip
        config = {"kind": KIND, "layout": layout.to_dict(), "vq_model": asdict(vq.config),
                  "vqvae_run": str(Path(vq_run).resolve()), "vqvae_sha256": sha256_file(vq_weights),
                  "image_dataset": str(Path(data_dir).resolve()),
                  "image_fingerprint": data.fingerprint(), "caption_vocab": vocab_size}  # fmt: skip
        source = SourceEntry(str(Path(data_dir).resolve()),
                             {s: e.documents for s, e in splits.items()},
                             {s: e.tokens for s, e in splits.items()})  # fmt: skip
        manifest = Manifest(entry, dtype_name(dtype), splits, (source,), config, creation_time(),
                            __version__)  # fmt: skip
        manifest.write(tmp)
        install_dataset(tmp, out)
    except BaseException:
        for writer in writers:
            writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
