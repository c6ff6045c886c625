"""Recurrent sequence mixers: Mamba-2 (SSD) and Gated DeltaNet, switches of the same Transformer.

Both carry a fixed-size state per head instead of a growing KV cache, and both have two forms
that compute the same function: a chunked form for training and prefill (matmuls inside chunks
of L tokens, the state passed between chunks) and a recurrent form for decoding (one token at a
time). `layer_pattern` in the config places them; they take the attention's place in a Block.

Mamba-2 (Dao & Gu 2024), per head with a scalar decay, state h (P, N):
    h_t = exp(Δ_t·A)·h_{t-1} + Δ_t·x_t ⊗ B_t,     y_t = h_t·C_t + D·x_t
Gated DeltaNet (Yang et al. 2024), per head, state S (Dk, Dv), keys and queries L2-normalised:
    S_t = exp(g_t)·S_{t-1};  S_t += k_t ⊗ β_t·(v_t − S_tᵀk_t),   o_t = S_tᵀq_t / √Dk
Its chunked form is the WY / UT transform: inside a chunk the rank-one updates compose to
(I + A)⁻¹ with A = strictly-lower(β·K·Kᵀ ⊙ decay), one triangular solve per chunk.

The module layout follows transformers' Mamba2Mixer (in_proj [z | x B C | Δ], depthwise conv,
gated RMSNorm, out_proj) and Qwen3-Next's GatedDeltaNet, so weights map one to one (hf/mamba2.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.errors import KilnError
from kiln.model.config import ModelConfig

if TYPE_CHECKING:
    from kiln.model.kv_cache import AttentionCache

L2_EPS = 1e-6  # DeltaNet's q/k L2 norm: x / √(Σx² + eps), as flash-linear-attention's


class GatedRMSNorm(nn.Module):
    """RMSNorm of y·silu(z) over groups of `group` features, then a scale (Mamba-2's norm)."""

    def __init__(self, dim: int, group: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group, self.eps = group, eps

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        """(..., dim) normalised in fp32, returned in y's dtype."""
        h = y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], -1, self.group)  # (..., groups, group)
        g = g * torch.rsqrt(g.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view_as(h).to(y.dtype)


def padding_mask(cache: Any, batch: int, T: int, device: torch.device) -> Tensor | None:
    """(B, T) True at real tokens when a cache left-pads rows (generate's ragged prompts)."""
    first_valid = None if cache is None else cache.first_valid
    if first_valid is None:
        return None
    slots = torch.arange(cache.length, cache.length + T, device=device)  # (T,)
    return slots[None] >= first_valid[:, None].to(device)  # (B, T)


def causal_conv(
    u: Tensor, conv: nn.Conv1d, state: Tensor | None, valid: Tensor | None
) -> tuple[Tensor, Tensor]:
    """SiLU(depthwise causal conv) of u (B, T, C) after `state` (B, C, K-1); new state.

    Padding positions (valid False) are zeroed on the way in and out, so a left-padded row's
    state stays exactly zero until its first real token, as if the row were alone.
    """
    B, _, Cd = u.shape
    K = conv.kernel_size[0]
    u = u.transpose(1, 2)  # (B, C, T)
    if valid is not None:
        u = u * valid[:, None, :].to(u.dtype)
    prev = u.new_zeros(B, Cd, K - 1) if state is None else state.to(u.dtype)
    full = torch.cat([prev, u], dim=-1)  # (B, C, K-1+T)
    out = F.silu(F.conv1d(full, conv.weight, conv.bias, groups=Cd)).transpose(1, 2)  # (B, T, C)
    if valid is not None:
        out = out * valid[..., None].to(out.dtype)
    return out, full[:, :, full.size(-1) - (K - 1) :]


def _recurrent_state(cache: Any, layer: int) -> tuple[Tensor, Tensor] | None:
    """This layer's (conv state, SSM state) from the cache, refusing a cache that has none."""
    if cache is None:
        return None
    if not hasattr(cache, "recurrent"):
        raise KilnError(
            f"{type(cache).__name__} holds no recurrent state for a Mamba-2 / Gated DeltaNet "
            "layer (model.layer_pattern): decode with kiln.model.generate"
        )
    return cache.recurrent(layer)


# ---- Mamba-2 ------------------------------------------------------------------------------------


def ssd_chunked(
    x: Tensor, dt: Tensor, A: Tensor, Bm: Tensor, Cm: Tensor, chunk: int, h0: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Mamba-2's SSD in chunks: y (B, T, H, P) and the final state (B, H, P, N).

    x (B, T, H, P), dt (B, T, H) after softplus, A (H,) negative, Bm and Cm (B, T, G, N).
    Inside a chunk y is a masked matmul (the "attention-like" dual form); between chunks
    the state carries exp(ΣΔA) decay. fp32 throughout.
    """
    B, T, H, P = x.shape
    G, N = Bm.shape[2], Bm.shape[3]
    L = min(chunk, T)
    pad = (-T) % L
    if pad:  # Δ = 0 at padding: no decay, no input, so the final state is unchanged
        x, dt, Bm, Cm = (F.pad(t, (0,) * (2 * t.dim() - 4) + (0, pad)) for t in (x, dt, Bm, Cm))
    x, dt, Bm, Cm = x.float(), dt.float(), Bm.float(), Cm.float()
    a = dt * A.float()  # (B, T', H) log decay per step
    h = x.new_zeros(B, H, P, N) if h0 is None else h0.float()
    per_group = H // G
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    ys = []
    for s in range(0, T + pad, L):
        xi, dti, Bi, Ci = x[:, s : s + L], dt[:, s : s + L], Bm[:, s : s + L], Cm[:, s : s + L]
        cum = a[:, s : s + L].cumsum(1)  # (B, L, H)
        seg = (cum[:, :, None] - cum[:, None]).masked_fill(~causal[None, :, :, None], -math.inf)
        decay = seg.exp().permute(0, 3, 1, 2)  # (B, H, Lt, Ls): exp(cum_t − cum_s), s ≤ t
        scores = torch.einsum("btgn,bsgn->bgts", Ci, Bi).repeat_interleave(per_group, 1)
        w = scores * decay * dti.transpose(1, 2)[:, :, None, :]  # (B, H, Lt, Ls)
        y = torch.einsum("bhts,bshp->bthp", w, xi)  # within the chunk
        Ch = Ci.repeat_interleave(per_group, 2) * cum.exp()[..., None]  # (B, L, H, N)
        y = y + torch.einsum("bthn,bhpn->bthp", Ch, h)  # from the state entering the chunk
        to_end = (cum[:, -1:] - cum).exp() * dti  # (B, L, H)
        Bh = Bi.repeat_interleave(per_group, 2) * to_end[..., None]  # (B, L, H, N)
        h = cum[:, -1].exp()[..., None, None] * h + torch.einsum("bshn,bshp->bhpn", Bh, xi)
        ys.append(y)
    return torch.cat(ys, dim=1)[:, :T], h


def ssd_recurrent(
    x: Tensor, dt: Tensor, A: Tensor, Bm: Tensor, Cm: Tensor, h0: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The same SSD one step at a time (decoding): y (B, T, H, P), final state (B, H, P, N)."""
    B, T, H, P = x.shape
    per_group = H // Bm.shape[2]
    x, dt, A = x.float(), dt.float(), A.float()
    Bh = Bm.float().repeat_interleave(per_group, 2)  # (B, T, H, N)
    Ch = Cm.float().repeat_interleave(per_group, 2)
    h = x.new_zeros(B, H, P, Bm.shape[3]) if h0 is None else h0.float()
    ys = []
    for t in range(T):
        inp = (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]  # (B, H, P, N)
        h = (dt[:, t] * A).exp()[..., None, None] * h + inp
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, t]))
    return torch.stack(ys, dim=1), h


class Mamba2Mixer(nn.Module):
    """Mamba-2's mixer, in transformers' Mamba2Mixer layout, with a Block's mixer interface."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        s = cfg.ssm
        self.layer, self.window = layer, None  # window: the Block's mask lookup key
        self.inner, self.n_heads, self.head_dim = cfg.mamba_inner, cfg.mamba_heads, s.head_dim
        self.n_groups, self.state_size, self.chunk = s.n_groups, s.state_size, s.chunk_size
        self.dt_range = (s.dt_min, s.dt_max, s.dt_floor)
        self.conv_dim = self.inner + 2 * s.n_groups * s.state_size
        # [z | x B C | Δ]: the gate, the conv's input, one time step per head
        self.w_in = nn.Linear(cfg.n_embd, self.inner + self.conv_dim + self.n_heads, bias=cfg.bias)
        self.conv = nn.Conv1d(self.conv_dim, self.conv_dim, s.conv_kernel, groups=self.conv_dim)
        self.dt_bias = nn.Parameter(torch.empty(self.n_heads))
        self.A_log = nn.Parameter(torch.empty(self.n_heads))
        self.D = nn.Parameter(torch.empty(self.n_heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // s.n_groups, cfg.norm_eps)
        self.out_proj = nn.Linear(self.inner, cfg.n_embd, bias=cfg.bias)

    @torch.no_grad()
    def init_ssm(self) -> None:
        """Mamba's own init: A = −[1..H], D = 1, Δ log-uniform in [dt_min, dt_max], conv as torch."""
        lo, hi, floor = self.dt_range
        self.A_log.copy_(torch.log(torch.arange(1, self.n_heads + 1, dtype=torch.float32)))
        self.D.fill_(1.0)
        dt = torch.exp(torch.rand(self.n_heads) * (math.log(hi) - math.log(lo)) + math.log(lo))
        dt = dt.clamp(min=floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
        self.conv.reset_parameters()

    def forward(
        self, x: Tensor, rope: Any, mask: Any, cache: AttentionCache | None = None
    ) -> Tensor:
        """(B, T, C) -> (B, T, C); with a cache, continue its state (chunked, or one step)."""
        B, T, _ = x.shape
        z, xbc, dt = self.w_in(x).split([self.inner, self.conv_dim, self.n_heads], dim=-1)
        if cache is not None and hasattr(cache, "scan"):  # a ragged batch: per-sequence states
            y = cache.scan(self.layer, self.scan, xbc, dt)
        else:
            y, state = self.scan(xbc, dt, state=_recurrent_state(cache, self.layer),
                                 one_step=cache is not None and T == 1,
                                 valid=padding_mask(cache, B, T, x.device))  # fmt: skip
            if cache is not None:
                cache.set_recurrent(self.layer, *state)
        y = self.norm(y, z)
        return self.out_proj(y.to(x.dtype))

    def scan(
        self, xbc: Tensor, dt: Tensor, *, state: tuple[Tensor, Tensor] | None = None,
        one_step: bool = False, valid: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:  # fmt: skip
        """The recurrent core after `state`: y (B, T, inner) in fp32 and the new (conv, SSM) state.

        xbc (B, T, conv_dim) and dt (B, T, H) are in_proj's slices; one_step takes the recurrent
        form (decoding), else the chunked one.
        """
        B, T, _ = xbc.shape
        H, P, G, N = self.n_heads, self.head_dim, self.n_groups, self.state_size
        conv_state, h0 = (None, None) if state is None else state
        xbc, conv_state = causal_conv(xbc, self.conv, conv_state, valid)
        xs, Bm, Cm = xbc.split([self.inner, G * N, G * N], dim=-1)
        xs = xs.reshape(B, T, H, P)
        dt = F.softplus(dt.float() + self.dt_bias.float())  # (B, T, H)
        A = -torch.exp(self.A_log.float())  # (H,)
        args = (xs, dt, A, Bm.reshape(B, T, G, N), Cm.reshape(B, T, G, N))
        if one_step:
            y, h = ssd_recurrent(*args, h0=h0)
        else:
            y, h = ssd_chunked(*args, self.chunk, h0)
        y = y + xs.float() * self.D.float()[:, None]  # (B, T, H, P)
        return y.reshape(B, T, self.inner), (conv_state, h)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-sequence (conv state, SSM state) shapes: constant whatever the length."""
        return (self.conv_dim, self.conv.kernel_size[0] - 1), (
            self.n_heads, self.head_dim, self.state_size,
        )  # fmt: skip


# ---- Gated DeltaNet -----------------------------------------------------------------------------


def delta_rule_chunked(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, chunk: int, S0: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The gated delta rule in chunks (WY / UT form): o (B, T, H, Dv), final state (B, H, Dk, Dv).

    q, k (B, T, H, Dk) (q already scaled), v (B, T, H, Dv), beta and g (B, T, H), g ≤ 0 the log
    decay. Inside a chunk, with G the cumulative decay and Γ_ts = exp(G_t − G_s) (s ≤ t):
        U = (I + A)⁻¹ (β·V),  W = (I + A)⁻¹ (β·exp(G)·K),  A = strictly-lower(β·K·Kᵀ ⊙ Γ)
        V' = U − W·S,  O = exp(G)·Q·S + (Q·Kᵀ ⊙ Γ)·V',  S ← exp(G_L)·S + (exp(G_L − G)·K)ᵀ·V'
    """
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    L = min(chunk, T)
    pad = (-T) % L
    # (B, H, T, .) in fp32; padding has k = 0, β = 0, g = 0: no update, no decay
    q, k, v = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)).transpose(1, 2) for t in (q, k, v))
    beta, g = (F.pad(t.float(), (0, 0, 0, pad)).transpose(1, 2) for t in (beta, g))
    S = q.new_zeros(B, H, Dk, Dv) if S0 is None else S0.float()
    eye = torch.eye(L, device=q.device)
    lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    strict = lower.tril(-1)
    outs = []
    for s in range(0, T + pad, L):
        qi, ki, vi = q[:, :, s : s + L], k[:, :, s : s + L], v[:, :, s : s + L]  # (B, H, L, D)
        bi, G = beta[:, :, s : s + L], g[:, :, s : s + L].cumsum(-1)  # (B, H, L)
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, -math.inf).exp()
        kb = ki * bi[..., None]
        A = ((kb @ ki.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
        inv = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
        U = inv @ (vi * bi[..., None])  # (B, H, L, Dv)
        W = inv @ (kb * G.exp()[..., None])  # (B, H, L, Dk)
        v_new = U - W @ S
        scores = (qi @ ki.transpose(-1, -2)) * decay  # (B, H, L, L), diagonal included
        outs.append((qi * G.exp()[..., None]) @ S + scores @ v_new)
        to_end = (G[..., -1:] - G).exp()[..., None]  # (B, H, L, 1)
        S = G[..., -1].exp()[..., None, None] * S + (ki * to_end).transpose(-1, -2) @ v_new
    return torch.cat(outs, dim=2).transpose(1, 2)[:, :T], S


def delta_rule_recurrent(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, S0: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The gated delta rule one step at a time: o (B, T, H, Dv), final state (B, H, Dk, Dv)."""
    B, T, H, Dk = k.shape
    q, k, v, beta, g = q.float(), k.float(), v.float(), beta.float(), g.float()
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if S0 is None else S0.float()
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        recalled = torch.einsum("bhkv,bhk->bhv", S, k[:, t])  # what the state holds for k_t
        delta = (v[:, t] - recalled) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet's mixer in Qwen3-Next's shape: conv over q, k, v; gated RMSNorm per head."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        s = cfg.ssm
        self.layer, self.window = layer, None
        self.n_heads, self.head_dim, self.chunk = cfg.delta_heads, cfg.delta_head_dim, s.chunk_size
        width = self.n_heads * self.head_dim
        self.width, self.conv_dim = width, 3 * width
        # [q | k | v | z | b | a]: queries, keys, values, the output gate, β and Δ per head
        self.w_in = nn.Linear(cfg.n_embd, 4 * width + 2 * self.n_heads, bias=cfg.bias)
        self.conv = nn.Conv1d(
            self.conv_dim, self.conv_dim, s.conv_kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.empty(self.n_heads))
        self.A_log = nn.Parameter(torch.empty(self.n_heads))
        self.norm = GatedRMSNorm(self.head_dim, self.head_dim, cfg.norm_eps)  # shared by heads
        self.out_proj = nn.Linear(width, cfg.n_embd, bias=cfg.bias)

    @torch.no_grad()
    def init_ssm(self) -> None:
        """A log-uniform in [1, 16], Δ bias at softplus⁻¹(1) (decays near exp(−A)), conv as torch."""
        self.A_log.copy_(torch.log(torch.empty(self.n_heads).uniform_(1, 16)))
        self.dt_bias.fill_(math.log(math.e - 1))
        self.conv.reset_parameters()

    def forward(
        self, x: Tensor, rope: Any, mask: Any, cache: AttentionCache | None = None
    ) -> Tensor:
        """(B, T, C) -> (B, T, C); with a cache, continue its state (chunked, or one step)."""
        B, T, _ = x.shape
        H, D, w = self.n_heads, self.head_dim, self.width
        qkv, z, b, a = self.w_in(x).split([3 * w, w, H, H], dim=-1)
        if cache is not None and hasattr(cache, "scan"):  # a ragged batch: per-sequence states
            o = cache.scan(self.layer, self.scan, qkv, b, a)
        else:
            o, state = self.scan(qkv, b, a, state=_recurrent_state(cache, self.layer),
                                 one_step=cache is not None and T == 1,
                                 valid=padding_mask(cache, B, T, x.device))  # fmt: skip
            if cache is not None:
                cache.set_recurrent(self.layer, *state)
        o = self.norm(o.view(B, T, H, D), z.reshape(B, T, H, D))  # (B, T, H, D)
        return self.out_proj(o.reshape(B, T, w).to(x.dtype))

    def scan(
        self, qkv: Tensor, b: Tensor, a: Tensor, *, state: tuple[Tensor, Tensor] | None = None,
        one_step: bool = False, valid: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:  # fmt: skip
        """The recurrent core after `state`: o (B, T, H·D) in fp32 and the new (conv, S) state."""
        B, T, _ = qkv.shape
        H, D, w = self.n_heads, self.head_dim, self.width
        conv_state, S0 = (None, None) if state is None else state
        qkv, conv_state = causal_conv(qkv, self.conv, conv_state, valid)
        q, k, v = (t.reshape(B, T, H, D).float() for t in qkv.split(w, dim=-1))
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + L2_EPS) * D**-0.5
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + L2_EPS)
        beta = torch.sigmoid(b.float())  # (B, T, H)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # (B, T, H)
        if one_step:
            o, S = delta_rule_recurrent(q, k, v, beta, g, S0)
        else:
            o, S = delta_rule_chunked(q, k, v, beta, g, self.chunk, S0)
        return o.reshape(B, T, w), (conv_state, S)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-sequence (conv state, delta-rule state) shapes: constant whatever the length."""
        return (self.conv_dim, self.conv.kernel_size[0] - 1), (
            self.n_heads, self.head_dim, self.head_dim,
        )  # fmt: skip


def make_mixer(cfg: ModelConfig, layer: int) -> nn.Module:
    """The recurrent mixer `cfg.layer_pattern` puts at this layer (not for attention layers)."""
    kind = cfg.layer_mixer(layer)
    if kind == "mamba2":
        return Mamba2Mixer(cfg, layer)
    if kind == "deltanet":
        return GatedDeltaNet(cfg, layer)
    raise ValueError(f"layer {layer} is an attention layer, not a recurrent mixer")
