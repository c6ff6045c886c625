"""Structured pruning: a smaller Transformer of the same family, cut along its own dimensions.

Width (Minitron, Muralidharan et al. 2024): every prunable unit is ranked by its activation on
calibration batches, and the most important are kept:

- attention heads: the norm of each head's output (the input of `attn.proj`, per head) averaged
  over tokens. GQA groups stay whole: `n_kv_head` keeps the groups (a key/value head with its
  query heads) whose summed score is highest; `n_head` then keeps the same number of the best
  query heads inside every kept group, so each key/value head still serves `n_head / n_kv_head`;
- MLP channels: the mean |activation| entering `mlp.proj` (after the gate for SwiGLU);
- embedding channels: the mean |value| of every norm's output over the residual stream (the
  norms' inputs are what each block reads); the channel is cut from every matrix that reads or
  writes the residual stream, from the embeddings and the head, and from every norm.

Depth (ShortGPT's block influence, Men et al. 2024): a block's score is 1 - cos(x_in, x_out) of
the residual stream across it, averaged over tokens; the blocks that change it least go.

The result is a ModelConfig with the smaller sizes written out (head_dim and d_ff explicit, so
the derived widths cannot drift) and a state dict sliced from the source's; `Transformer`'s own
check then confirms the parameter count the config computes. Architectures whose shapes this
does not cover (MoE, MLA, fused parallel blocks) are refused by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kiln.errors import KilnError
from kiln.model.config import ModelConfig
from kiln.model.transformer import Transformer


@dataclass(frozen=True)
class PruneTargets:
    """The sizes to keep (None: keep all of that dimension)."""

    n_layer: int | None = None
    n_head: int | None = None
    n_kv_head: int | None = None
    n_embd: int | None = None
    d_ff: int | None = None

    def resolve(self, cfg: ModelConfig) -> dict[str, int]:
        """Every target as a number, checked against the source config (flag names in errors)."""
        H, Hkv = cfg.n_head, cfg.kv_heads
        out = {
            "n_layer": self.n_layer or cfg.n_layer, "n_head": self.n_head or H,
            "n_kv_head": self.n_kv_head or Hkv, "n_embd": self.n_embd or cfg.n_embd,
            "d_ff": self.d_ff or cfg.ff_size,
        }  # fmt: skip
        have = {"n_layer": cfg.n_layer, "n_head": H, "n_kv_head": Hkv, "n_embd": cfg.n_embd,
                "d_ff": cfg.ff_size}  # fmt: skip
        for name, value in out.items():
            if not 1 <= value <= have[name]:
                flag = "--" + name.replace("_", "-")
                raise KilnError(f"{flag} {value}: must be between 1 and the model's {have[name]}")
        if out["n_head"] % out["n_kv_head"]:
            raise KilnError(
                f"--n-head {out['n_head']} must be a multiple of --n-kv-head {out['n_kv_head']} "
                "(every key/value head serves the same number of query heads)"
            )
        per_group = out["n_head"] // out["n_kv_head"]
        if per_group > H // Hkv:
            raise KilnError(
                f"--n-head {out['n_head']} with --n-kv-head {out['n_kv_head']} needs {per_group} "
                f"query heads per group; the model's groups have {H // Hkv}"
            )
        return out


@dataclass
class Importance:
    """Per-unit scores from calibration batches (higher: more important)."""

    heads: list[Tensor]  # per layer, (n_head,)
    channels: list[Tensor]  # per layer, (d_ff,)
    embd: Tensor  # (n_embd,)
    blocks: Tensor  # (n_layer,): 1 - cos(residual in, residual out)
    tokens: int = 0


def check_prunable(cfg: ModelConfig, depth: bool) -> None:
    """Refuse architectures whose shapes `prune_model` does not cover, naming the field."""
    for ok, field in (
        (cfg.moe is None, "model.moe (mixture of experts)"),
        (cfg.mla is None, "model.mla (latent attention)"),
        (not cfg.parallel_block, "model.parallel_block"),
        (not depth or cfg.sliding_window is None, "model.sliding_window with depth pruning"),
    ):
        if not ok:
            raise KilnError(f"kiln prune: {field} is not supported")


@torch.no_grad()
def measure_importance(model: Transformer, batches: Iterable[Tensor]) -> Importance:
    """Score heads, MLP channels, embedding channels and blocks on token batches (B, T) each."""
    cfg = model.cfg
    L, H, D = cfg.n_layer, cfg.n_head, cfg.head_size
    heads = [torch.zeros(H) for _ in range(L)]
    channels = [torch.zeros(cfg.ff_size) for _ in range(L)]
    embd, blocks = torch.zeros(cfg.n_embd), torch.zeros(L)
    hooks = []

    def on_attn(i: int) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple[Tensor, ...]) -> None:
            y = args[0].float()  # (B, T, H·D): the heads' outputs, side by side
            heads[i].add_(y.unflatten(-1, (H, D)).norm(dim=-1).sum(dim=(0, 1)).cpu())

        return hook

    def on_mlp(i: int) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple[Tensor, ...]) -> None:
            channels[i].add_(args[0].float().abs().sum(dim=(0, 1)).cpu())  # (F,)

        return hook

    def on_norm(_: nn.Module, __: tuple[Tensor, ...], out: Tensor) -> None:
        embd.add_(out.float().abs().sum(dim=(0, 1)).cpu())  # (C,)

    def on_block(i: int) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
            x, y = args[0].float(), out.float()  # (B, T, C) each
            blocks[i] += (1 - torch.cosine_similarity(x, y, dim=-1)).sum().cpu()

        return hook

    for i, block in enumerate(model.blocks):
        hooks.append(block.attn.proj.register_forward_pre_hook(on_attn(i)))
        hooks.append(block.mlp.proj.register_forward_pre_hook(on_mlp(i)))
        hooks.append(block.register_forward_hook(on_block(i)))
        for name in ("norm1", "norm2", "norm1_post", "norm2_post"):
            norm = getattr(block, name, None)
            if isinstance(norm, nn.Module) and not isinstance(norm, nn.Identity):
                hooks.append(norm.register_forward_hook(on_norm))
    if not isinstance(model.norm_f, nn.Identity):
        hooks.append(model.norm_f.register_forward_hook(on_norm))
    tokens = 0
    try:
        for x in batches:
            model(x)
            tokens += x.numel()
    finally:
        for h in hooks:
            h.remove()
    if tokens == 0:
        raise KilnError("kiln prune: no calibration tokens")
    return Importance(
        [h / tokens for h in heads], [c / tokens for c in channels], embd / tokens,
        blocks / tokens, tokens,
    )  # fmt: skip


def top(scores: Tensor, k: int) -> Tensor:
    """Indices of the k highest scores, in their original order."""
    return torch.sort(torch.topk(scores, k).indices).values


def kept_heads(scores: Tensor, n_kv: int, n_head: int, groups: int) -> tuple[Tensor, Tensor]:
    """(kept query heads, kept key/value heads): whole groups, then the best heads in each."""
    per_group = scores.view(groups, -1)  # (Hkv, H / Hkv)
    kv = top(per_group.sum(dim=1), n_kv)
    q = [g * per_group.size(1) + top(per_group[g], n_head // n_kv) for g in kv.tolist()]
    return torch.cat(q), kv


def dims(heads: Tensor, head_dim: int) -> Tensor:
    """The feature indices of whole heads in a (…, heads · head_dim) layout."""
    return (heads[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)


def prune_model(model: Transformer, imp: Importance, targets: PruneTargets) -> Transformer:
    """A new, smaller Transformer holding the kept parts of `model` (eval mode)."""
    cfg = model.cfg
    sizes = targets.resolve(cfg)
    check_prunable(cfg, sizes["n_layer"] < cfg.n_layer)
    D, H, Hkv, F = cfg.head_size, cfg.n_head, cfg.kv_heads, cfg.ff_size
    new_cfg = dataclasses.replace(cfg, **sizes, head_dim=D)
    c = top(imp.embd, sizes["n_embd"])
    layers = top(imp.blocks, sizes["n_layer"]).tolist()
    old = model.state_dict()
    new: dict[str, Tensor] = {}
    for name in ("wte.weight", "wpe.weight", "lm_head.weight"):
        if name in old:
            new[name] = old[name][:, c]
    for name in ("norm_f.weight", "norm_f.bias"):
        if name in old:
            new[name] = old[name][c]
    for j, i in enumerate(layers):
        q, kv = kept_heads(imp.heads[i], sizes["n_kv_head"], sizes["n_head"], Hkv)
        f = top(imp.channels[i], sizes["d_ff"])
        qkv_rows = torch.cat([dims(q, D), H * D + dims(kv, D), (H + Hkv) * D + dims(kv, D)])
        fc_rows = torch.cat([f, F + f]) if cfg.gated else f
        rows = {"attn.qkv": qkv_rows, "mlp.fc": fc_rows}  # input projections: read the stream
        cols = {"attn.proj": dims(q, D), "mlp.proj": f}  # output projections: write it
        prefix, to = f"blocks.{i}.", f"blocks.{j}."
        for key, tensor in old.items():
            if not key.startswith(prefix):
                continue
            part = key[len(prefix) :]
            module, _, kind = part.rpartition(".")
            if module in rows:
                t = tensor[rows[module]]
                t = t[:, c] if kind == "weight" else t
            elif module in cols:
                t = tensor[c][:, cols[module]] if kind == "weight" else tensor[c]
            elif part == "attn.sinks":
                t = tensor[q]
            elif module in ("attn.q_norm", "attn.k_norm"):
                t = tensor  # per head_dim, which pruning keeps
            elif module.startswith("norm"):
                t = tensor[c]
            else:
                raise KilnError(f"kiln prune: do not know how to prune {key}")
            new[to + part] = t
    pruned = Transformer(new_cfg)  # checks its parameter count against new_cfg's
    if cfg.tie_embeddings:
        new.pop("lm_head.weight", None)
    missing, unexpected = pruned.load_state_dict(new, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise KilnError(
            f"kiln prune: shapes left over (missing {missing}, unexpected {unexpected})"
        )
    if sum(t.numel() for k, t in new.items()) != new_cfg.num_params():
        raise KilnError("kiln prune: sliced tensors do not add up to the new config's parameters")
    pruned.init_rope()
    return pruned.eval()
