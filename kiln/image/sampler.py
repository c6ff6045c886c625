"""Drawing pictures from captions with a trained DiT run: `load_image_model(run_dir).sample(...)`.

The sampling loop (classifier-free guidance, DDIM / DDPM / Euler steps, previews) lives here so
the trainer's evaluation, `kiln image sample`, the benchmark and the server draw the same way.
A run is read from its newest checkpoint (`checkpoints/latest` -> `step_N/model.safetensors`
and `state.json`, the layout of kiln/checkpoint_format.py, which sits a layer above this one)
and its `tokenizer.json`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kiln.errors import KilnError, not_found
from kiln.image.captions import encode_captions
from kiln.image.dit import DiTConfig, TextToImage
from kiln.image.schedules import DiffusionConfig, Schedule
from kiln.image.token_model import TokenImageModel, is_token_run, load_token_image_model
from kiln.image.vqvae import VQVAEConfig

OnStep = Callable[[int, Tensor], None]


def noise_for(n: int, shape: tuple[int, ...], seed: int, call: int) -> Tensor:
    """(n, *shape) normal noise; picture i's depends on (seed, i, call) only, not on n."""
    rows = []
    for i in range(n):
        g = torch.Generator().manual_seed((seed * 1_000_003 + i) * 4099 + call)
        rows.append(torch.randn(shape, generator=g))
    return torch.stack(rows)


@torch.no_grad()
def sample_latents(
    model: TextToImage, ids: Tensor, schedule: Schedule, steps: int, guidance: float, seed: int,
    on_step: Callable[[int, Tensor], None] | None = None,
) -> Tensor:  # fmt: skip
    """Normalised latents (N, C, h, w) for caption ids (N, L), guided by `guidance`.

    on_step(step, x0_estimate) is called after each of the `steps` steps with the latents the
    current prediction implies (what a preview decodes).
    """
    dit = model.dit
    device = ids.device
    n = ids.shape[0]
    shape = (dit.channels, dit.side, dit.side)
    x = noise_for(n, shape, seed, 0).to(device)
    empty = torch.full_like(ids, dit.text.pad_id)
    empty[:, 0] = dit.text.start_id
    guided = guidance != 1.0
    both = torch.cat([ids, empty]) if guided else ids
    for i, t in enumerate(schedule.timesteps(steps)):
        tt = torch.full(
            (both.shape[0],), schedule.model_time(torch.tensor(t)).item(), device=device
        )
        xin = torch.cat([x, x]) if guided else x
        out = dit(xin, tt, both)
        if guided:  # classifier-free guidance: uncond + g·(cond - uncond)
            cond, uncond = out.chunk(2)
            out = uncond + guidance * (cond - uncond)
        noise = noise_for(n, shape, seed, i + 1).to(device) if schedule.needs_noise() else None
        if on_step is not None:
            on_step(i, schedule.x0_estimate(out, t, x))
        x = schedule.step(out, t, x, steps, noise)
    return x


class ImageModel:
    """A trained text-to-image model, ready to draw: `.sample(prompts, seed)` and `.size`."""

    def __init__(
        self, model: TextToImage, tokenizer: Any, diffusion: DiffusionConfig, source: str
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.diffusion = diffusion
        self.schedule = Schedule(diffusion)
        self.source = source

    @property
    def size(self) -> int:
        """The side of the pictures it draws, in pixels."""
        return self.model.vq_config.image_size

    @property
    def device(self) -> torch.device:
        """Where the model's weights are."""
        return self.model.latent_mean.device

    def caption_ids(self, prompts: Sequence[str], what: str = "prompt") -> Tensor:
        """Token ids (N, L) of `prompts`; a bad prompt is a KilnError naming `what`."""
        if not prompts:
            raise KilnError(f"{what}: give at least one caption")
        text = self.model.dit.text
        return encode_captions(
            self.tokenizer, prompts, self.model.config.max_caption_tokens, text.start_id,
            text.pad_id, what,
        ).to(self.device)  # fmt: skip

    @torch.no_grad()
    def sample(
        self, prompts: list[str], seed: int, steps: int | None = None,
        on_step: OnStep | None = None, guidance: float | None = None,
    ) -> Tensor:  # fmt: skip
        """Pictures (N, 3, H, W) in [0, 1], one per prompt; on_step(step, previews) per step."""
        steps = steps or self.diffusion.sample_steps
        if not 1 <= steps <= self.diffusion.timesteps:
            raise KilnError(f"steps must be in [1, {self.diffusion.timesteps}], got {steps}")
        ids = self.caption_ids(prompts)
        scale = self.diffusion.guidance if guidance is None else guidance

        def preview(step: int, z0: Tensor) -> None:
            assert on_step is not None
            on_step(step, (self.model.decode(z0).cpu() + 1) / 2)

        z = sample_latents(
            self.model, ids, self.schedule, steps, scale, seed, preview if on_step else None
        )
        return (self.model.decode(z).cpu() + 1) / 2


def _dataclass(cls: Any, data: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def read_run(run_dir: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint directory of a DiT run and its state.json."""
    root = Path(run_dir)
    if not root.is_dir():
        raise not_found(root, "DiT run directory")
    pointer = root / "checkpoints" / "latest"
    if not pointer.is_file():
        raise KilnError(f"{root}: no checkpoints/latest; train it with `kiln image train-dit`")
    step = root / "checkpoints" / pointer.read_text(encoding="utf-8").strip()
    try:
        state = json.loads((step / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KilnError(f"{step / 'state.json'}: unreadable ({exc})") from None
    if "vq_model" not in state.get("config", {}):
        raise KilnError(f"{root}: not a DiT run (its checkpoint has no VQ-VAE config)")
    return step, state


def load_image_model(
    run_dir: str | os.PathLike[str], device: str = "cpu"
) -> ImageModel | TokenImageModel:
    """The text-to-image model of a `kiln image train-dit` run, in eval mode on `device`.

    A `kiln train` run on `kiln image tokens` shards gives its TokenImageModel instead: the same
    `.sample(prompts, seed, ...)`, `.caption_ids` and `.size`, drawn code by code.
    """
    from safetensors.torch import load_file

    from kiln.tokenizer import Tokenizer

    if is_token_run(run_dir):
        return load_token_image_model(run_dir, device)
    step, state = read_run(run_dir)
    config = state["config"]
    model = TextToImage(
        _dataclass(DiTConfig, config["model"]), _dataclass(VQVAEConfig, config["vq_model"])
    )
    model.load_state_dict(load_file(step / "model.safetensors"))
    tokenizer_file = Path(run_dir) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise not_found(tokenizer_file, "caption tokenizer file")
    diffusion = _dataclass(DiffusionConfig, config["diffusion"])
    return ImageModel(model.to(device), Tokenizer.load(tokenizer_file), diffusion, str(step))


def save_grid(
    images: Tensor, out: str | os.PathLike[str], columns: int = 4, scale: int = 3
) -> Path:
    """Write pictures (N, 3, H, W) in [0, 1] as one PNG grid, atomically."""
    from PIL import Image

    from kiln.io import atomic_write

    n, _, h, w = images.shape
    cols = min(columns, n)
    rows = (n + cols - 1) // cols
    grid = Image.new("RGB", (cols * w * scale, rows * h * scale), "white")
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for i, picture in enumerate(pixels):
        tile = Image.fromarray(picture).resize((w * scale, h * scale), Image.Resampling.NEAREST)
        grid.paste(tile, ((i % cols) * w * scale, (i // cols) * h * scale))
    path = Path(out)
    with atomic_write(path, "wb", encoding=None) as handle:
        grid.save(handle, format="PNG")
    return path
