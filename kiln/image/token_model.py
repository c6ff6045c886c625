"""Drawing with a Transformer trained on image tokens (kiln/image/tokens.py): the second route.

caption ids, `<|image|>` -> exactly h·w codes, each sampled from the logits of the code ids only
(the rest of the vocabulary is never a candidate), one decode step at a time on kiln's KV cache
(kiln.model.generate's prefill and step) -> the VQ-VAE's decoder. `TokenImageModel.sample` has
the signature of the DiT's `ImageModel.sample`, so `load_image_model` hands out either.

Picture i draws from its own generator seeded by (seed, i), so a picture does not depend on how
many are drawn with it. The run is read from its newest checkpoint (`checkpoints/latest`, the
layout of kiln/checkpoint_format.py, a layer above this one); the tokenizer, the layout and the
VQ-VAE come from the token dataset the run's config names (`data.dataset`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kiln.errors import KilnError
from kiln.image.tokens import (
    IMAGE,
    KIND,
    LAYOUT_KEY,
    VQVAE_FILE,
    TokenLayout,
    latest_step,
    read_state,
    vq_config,
)
from kiln.image.vqvae import VQVAE
from kiln.model.config import ModelConfig
from kiln.model.generate import decode_step, filter_logits
from kiln.model.kv_cache import KVCache
from kiln.model.transformer import Transformer

OnStep = Callable[[int, Tensor], None]


def row_generators(n: int, seed: int) -> list[torch.Generator]:
    """One generator per picture, seeded by (seed, i) alone."""
    return [torch.Generator().manual_seed((seed * 1_000_003 + i) * 4099 + 7) for i in range(n)]


@torch.inference_mode()
def sample_codes(
    model: Transformer, prompts: Sequence[Sequence[int]], layout: TokenLayout, seed: int,
    temperature: float = 1.0, top_k: int | None = None,
    on_code: Callable[[int, Tensor], None] | None = None,
) -> Tensor:  # fmt: skip
    """(N, grid, grid) code indices: h·w tokens per prompt, sampled among the code ids only.

    Each prompt ends with `<|image|>`; on_code(i, codes) is called after code i (raster order)
    with the (N, grid, grid) codes so far (zeros where none is drawn yet).
    """
    n, total = len(prompts), layout.codes_per_image
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    if width + total > model.cfg.block_size:
        raise KilnError(
            f"a caption of {width - 1} tokens + {total} codes exceeds the model's block_size "
            f"{model.cfg.block_size}"
        )
    param = next(model.parameters())
    device = param.device
    batch = torch.zeros(n, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
    first_valid = None
    if min(lengths) != width:  # left padding, masked out: each row decodes as it would alone
        first_valid = torch.tensor([width - k for k in lengths], device=device)
    cache = KVCache(model.cfg, n, width + total, device=device, dtype=param.dtype,
                    first_valid=first_valid)  # fmt: skip
    generators = row_generators(n, seed)
    codes = torch.zeros(n, total, dtype=torch.long)
    lo, hi = layout.code_base, layout.code_base + layout.codebook_size
    logits = decode_step(model, batch.to(device), cache)
    for i in range(total):
        allowed = logits[:, lo:hi].float().cpu()  # the constraint: code ids only
        if temperature == 0:
            picked = allowed.argmax(-1)
        else:
            probs = filter_logits(allowed, temperature, top_k).softmax(-1)
            picked = torch.cat([torch.multinomial(p[None], 1, generator=g)[0]
                                for p, g in zip(probs, generators, strict=True)])  # fmt: skip
        codes[:, i] = picked
        if on_code is not None:
            on_code(i, codes.view(n, layout.grid, layout.grid).clone())
        if i < total - 1:
            logits = decode_step(model, (picked + lo).to(device)[:, None], cache)
    return codes.view(n, layout.grid, layout.grid)


@dataclass(frozen=True)
class TokenSteps:
    """The sampling knobs by the names the DiT's `ImageModel.diffusion` has (what the CLI and
    the server read): a picture is h·w decode steps, with no guidance."""

    sample_steps: int
    timesteps: int
    guidance: float = 1.0


class TokenImageModel:
    """A Transformer over image tokens and the VQ-VAE that decodes them: `.sample(...)`, `.size`."""

    route = "tokens"

    def __init__(
        self, model: Transformer, tokenizer: Any, layout: TokenLayout, vq: VQVAE, source: str
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.layout = layout
        self.vq = vq.eval()
        self.source = source
        self.image_id = tokenizer.special_tokens[IMAGE]
        self.diffusion = TokenSteps(layout.codes_per_image, layout.codes_per_image)

    @property
    def size(self) -> int:
        """The side of the pictures it draws, in pixels."""
        return self.layout.image_size

    @property
    def device(self) -> torch.device:
        """Where the Transformer's weights are."""
        return next(self.model.parameters()).device

    def caption_ids(self, prompts: Sequence[str], what: str = "prompt") -> list[list[int]]:
        """Each prompt's ids ending with `<|image|>`; a bad prompt is a KilnError naming `what`."""
        if not prompts:
            raise KilnError(f"{what}: give at least one caption")
        out = []
        for text in prompts:
            try:
                ids = self.tokenizer.encode(text)
            except ValueError:
                raise KilnError(f"{what}: {text!r} contains control-token text") from None
            if len(ids) > self.layout.max_caption_tokens:
                raise KilnError(
                    f"{what}: {text!r} is {len(ids)} tokens; the model takes at most "
                    f"{self.layout.max_caption_tokens}"
                )
            out.append([*ids, self.image_id])
        return out

    def decode(self, codes: Tensor) -> Tensor:
        """Code indices (N, h, w) -> pictures (N, 3, H, W) in [0, 1]."""
        with torch.no_grad():
            return (self.vq.decode(codes.to(self.vq.quantizer.codebook.device)).cpu() + 1) / 2

    def sample(
        self, prompts: list[str], seed: int, steps: int | None = None,
        on_step: OnStep | None = None, guidance: float | None = None,
        temperature: float = 1.0, top_k: int | None = None,
    ) -> Tensor:  # fmt: skip
        """Pictures (N, 3, H, W) in [0, 1]; on_step(i, previews) after each code i.

        `steps` and `guidance` are the DiT's knobs: this route always draws h·w codes and has
        no unconditional branch, so a steps other than h·w or a guidance other than 1 is an error.
        """
        if steps is not None and steps != self.layout.codes_per_image:
            raise KilnError(
                f"steps: the token route draws exactly {self.layout.codes_per_image} codes a "
                f"picture, not {steps} steps (leave steps out)"
            )
        if guidance is not None and guidance != 1.0:
            raise KilnError("guidance: the token route has no classifier-free guidance (use 1)")
        if temperature < 0:
            raise KilnError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise KilnError(f"top_k must be >= 1, got {top_k}")
        ids = self.caption_ids(prompts)

        def preview(i: int, codes: Tensor) -> None:
            assert on_step is not None
            on_step(i, self.decode(codes))

        codes = sample_codes(self.model, ids, self.layout, seed, temperature, top_k,
                             preview if on_step else None)  # fmt: skip
        return self.decode(codes)


def token_dataset_of(run: Path, state: dict[str, Any]) -> Path | None:
    """The image-token dataset a run trained on (where recorded, else beside the run), or None."""
    dataset = state.get("config", {}).get("data", {}).get("dataset")
    if not dataset:
        return None
    for root in (Path(dataset), run.parent / Path(dataset).name):
        if (root / "manifest.json").is_file():
            from kiln.data.manifest import Manifest

            manifest = Manifest.read(root)
            return root if manifest.config.get("kind") == KIND else None
    return None


def is_token_run(run_dir: str | os.PathLike[str]) -> bool:
    """Whether `run_dir` is a `kiln train` run on an image-token dataset."""
    run = Path(run_dir)
    try:
        state = read_state(latest_step(run, "run"))
    except KilnError:
        return False
    return "vq_model" not in state.get("config", {}) and token_dataset_of(run, state) is not None


def _load_transformer(step: Path, state: dict[str, Any], device: str) -> Transformer:
    from safetensors.torch import load_file

    try:
        cfg = ModelConfig.from_dict(dict(state["config"]["model"]))
    except (KeyError, TypeError) as exc:
        raise KilnError(f"{step}/state.json: no usable config.model ({exc})") from None
    model = Transformer(cfg)
    tensors = load_file(step / "model.safetensors")
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # A tied head is stored once, as the embedding: its name is missing, its storage is not.
    own = model.state_dict()
    stored = {t.untyped_storage().data_ptr() for n, t in own.items() if n in tensors}
    missing = [n for n in missing if own[n].untyped_storage().data_ptr() not in stored]
    if missing or unexpected:
        raise KilnError(
            f"{step / 'model.safetensors'} does not match its config: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    return model.to(device).eval()


def load_token_image_model(run_dir: str | os.PathLike[str], device: str = "cpu") -> TokenImageModel:
    """The image-token model of a `kiln train` run on `kiln image tokens` shards, on `device`."""
    from safetensors.torch import load_file

    from kiln.data.manifest import Manifest
    from kiln.io import sha256_file
    from kiln.tokenizer import Tokenizer

    run = Path(run_dir)
    step = latest_step(run, "image-token run")
    state = read_state(step)
    root = token_dataset_of(run, state)
    if root is None:
        raise KilnError(
            f"{run}: its data.dataset is not an image-token dataset (kiln image tokens)"
        )
    manifest = Manifest.read(root)
    tok_file = root / "tokenizer.json"
    recorded = state.get("dataset", {}).get("tokenizer_sha256") or manifest.tokenizer.sha256
    if not tok_file.is_file() or sha256_file(tok_file) != recorded:
        raise KilnError(f"{tok_file}: missing or not the tokenizer {run} was trained with")
    tokenizer = Tokenizer.load(tok_file)
    layout = TokenLayout.from_dict(tokenizer.metadata.get(LAYOUT_KEY, {}), str(tok_file))
    vq = VQVAE(vq_config(manifest.config.get("vq_model", {})))
    vq.load_state_dict(load_file(root / VQVAE_FILE))
    model = _load_transformer(step, state, device)
    if model.cfg.vocab_size < tokenizer.n_vocab:
        raise KilnError(f"{step}: a {model.cfg.vocab_size}-token model, {tok_file} has more ids")
    return TokenImageModel(model, tokenizer, layout, vq.to(device), str(step))
