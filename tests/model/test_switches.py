"""Architecture switches (issue #21): each against a plain reference of its equations, its
parameter and FLOP accounting against the module, and its config errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from kiln.model import ModelConfig, ModelConfigError, Transformer
from kiln.model.accounting import PARAM_COMPONENTS, flop_count, mlp_params, param_tensor_count
from tests.model.helpers import build

# Each switch on its own over the tiny Llama-style preset (plus a GPT-style base for LayerNorm).
SWITCHES: dict[str, dict[str, object]] = {
    "relu": {"mlp": "relu"},
    "relu2": {"mlp": "relu2"},
    "gelu-tanh": {"mlp": "gelu"},
    "gelu-exact": {"mlp": "gelu_exact"},
    "swiglu": {"mlp": "swiglu"},
    "geglu": {"mlp": "geglu"},
    "sinusoidal": {"pos_emb": "sinusoidal", "embed_scale": True},
    "nope": {"pos_emb": "none"},
    "learned": {"pos_emb": "learned"},
    "partial-rope": {"rotary_fraction": 0.25},
    "post-norm": {"norm_placement": "post"},
    "sandwich-norm": {"norm_placement": "sandwich"},
    "no-norm-scale": {"norm_scale": False},
    "layernorm-no-scale": {"norm": "layernorm", "bias": True, "norm_scale": False},
    "parallel-fused": {"parallel_block": True},
    "parallel-fused-bias": {"parallel_block": True, "bias": True, "norm": "layernorm"},
    "parallel-two-norms": {"parallel_block": True, "parallel_norms": 2},
    "attn-softcap-scale": {"attn_softcap": 3.0, "attn_scale": 0.5},
    "mup": {"mup_base_width": 32},
}


def small(**switches: object) -> ModelConfig:
    """The tiny preset at test size with the given switches."""
    base = {"vocab_size": 128, "block_size": 32, "n_layer": 2, "rope_theta": 5000.0}
    return ModelConfig.preset("tiny", **{**base, **switches})


# ---- a plain reference of the equations, reading the module's weights by name ----------------


def ref_norm(cfg: ModelConfig, sd: dict[str, Tensor], name: str, x: Tensor) -> Tensor:
    """LayerNorm or RMSNorm over the last dim, with scale (and bias) if the config has them."""
    if cfg.norm == "rmsnorm":
        y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    else:
        mu = x.mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt((x - mu).pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    if cfg.norm_scale:
        y = y * sd[name + ".weight"]
        if name + ".bias" in sd:
            y = y + sd[name + ".bias"]
    return y


def linear(sd: dict[str, Tensor], name: str, x: Tensor) -> Tensor:
    """x·Wᵀ + b."""
    y = x @ sd[name + ".weight"].T
    return y + sd[name + ".bias"] if name + ".bias" in sd else y


def ref_activation(kind: str, h: Tensor) -> Tensor:
    """The activation functions written out from their definitions."""
    tanh_gelu = lambda u: 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))  # noqa: E731
    erf_gelu = lambda u: 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))  # noqa: E731
    if kind in ("swiglu", "geglu"):
        gate, up = h.chunk(2, dim=-1)
        return (gate * torch.sigmoid(gate) if kind == "swiglu" else tanh_gelu(gate)) * up
    return {
        "relu": lambda u: u.clamp(min=0),
        "relu2": lambda u: u.clamp(min=0) ** 2,
        "gelu": tanh_gelu,
        "gelu_exact": erf_gelu,
    }[kind](h)


def ref_rotate(cfg: ModelConfig, x: Tensor) -> Tensor:
    """RoPE on the first rope_dim dims of x (B, H, T, D), pairs (i, i + R/2), angle t·θ^(-2i/R)."""
    R, T = cfg.rope_dim, x.size(2)
    inv = cfg.rope_theta ** (-torch.arange(0, R, 2).double() / R)
    ang = torch.arange(T).double()[:, None] * inv  # (T, R/2)
    cos, sin = ang.cos().float(), ang.sin().float()
    a, b, rest = x[..., : R // 2], x[..., R // 2 : R], x[..., R:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin, rest), dim=-1)


def ref_attention(cfg: ModelConfig, qkv: Tensor, sd: dict[str, Tensor], p: str) -> Tensor:
    """Causal grouped-query attention with the config's scale, soft-cap and RoPE."""
    B, T, _ = qkv.shape
    H, Hkv, D = cfg.n_head, cfg.kv_heads, cfg.head_size
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q = q.view(B, T, H, D).transpose(1, 2)
    k = k.view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    v = v.view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    if cfg.pos_emb == "rope":
        q, k = ref_rotate(cfg, q), ref_rotate(cfg, k)
    if cfg.mup_base_width is not None:  # µP: 1/D, equal to 1/√D at the base width
        scale = math.sqrt(D * cfg.mup_base_width / cfg.n_embd) / D
    else:
        scale = cfg.attn_scale or 1 / math.sqrt(D)
    s = q @ k.transpose(-1, -2) * scale
    if cfg.attn_softcap:
        s = cfg.attn_softcap * torch.tanh(s / cfg.attn_softcap)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    y = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * D)
    return linear(sd, p + "attn.proj", y)


def ref_block(cfg: ModelConfig, sd: dict[str, Tensor], i: int, x: Tensor) -> Tensor:
    """One block wired as cfg.norm_placement / cfg.parallel_block say."""
    p = f"blocks.{i}."
    n = lambda name, u: ref_norm(cfg, sd, p + name, u)  # noqa: E731
    attn = lambda u: ref_attention(cfg, linear(sd, p + "attn.qkv", u), sd, p)  # noqa: E731
    mlp = lambda u: linear(sd, p + "mlp.proj", ref_activation(cfg.mlp, linear(sd, p + "mlp.fc", u)))  # noqa: E731
    if cfg.parallel_block and cfg.parallel_norms == 1:  # one projection: [q k v | mlp in]
        h = n("norm1", x)
        qkv, up = linear(sd, p + "in_proj", h).split(
            [
                (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_size,
                sd[p + "mlp.proj.weight"].size(1) * (2 if cfg.gated else 1),
            ],
            dim=-1,
        )
        mlp_out = linear(sd, p + "mlp.proj", ref_activation(cfg.mlp, up))
        return x + ref_attention(cfg, qkv, sd, p) + mlp_out
    if cfg.parallel_block:
        return x + attn(n("norm1", x)) + mlp(n("norm2", x))
    if cfg.norm_placement == "post":
        x = n("norm1", x + attn(x))
        return n("norm2", x + mlp(x))
    if cfg.norm_placement == "sandwich":
        x = x + n("norm1_post", attn(n("norm1", x)))
        return x + n("norm2_post", mlp(n("norm2", x)))
    x = x + attn(n("norm1", x))
    return x + mlp(n("norm2", x))


def ref_forward(model: Transformer, idx: Tensor) -> Tensor:
    """Logits of the whole model from the equations alone."""
    cfg, sd = model.cfg, model.state_dict()
    T = idx.size(1)
    x = sd["wte.weight"][idx]
    if cfg.embed_scale:
        x = x * math.sqrt(cfg.n_embd)
    if cfg.pos_emb == "learned":
        x = x + sd["wpe.weight"][:T]
    if cfg.pos_emb == "sinusoidal":
        pos = torch.arange(T).double()[:, None]
        i = torch.arange(cfg.n_embd).double()
        angle = pos / 10000 ** ((i - i % 2) / cfg.n_embd)  # dims 2i and 2i+1 share a frequency
        x = x + torch.where(i % 2 == 0, angle.sin(), angle.cos()).float()
    for i in range(cfg.n_layer):
        x = ref_block(cfg, sd, i, x)
    if cfg.norm_placement != "post":
        x = ref_norm(cfg, sd, "norm_f", x)
    x = x * (cfg.mup_base_width or cfg.n_embd) / cfg.n_embd  # µP output multiplier 1/m
    return (x @ sd["lm_head.weight"].T)[..., : cfg.vocab_size]


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_forward_equals_the_reference_equations(switches: dict[str, object]) -> None:
    model = build(small(**switches))
    idx = torch.randint(
        0, model.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        got, want = model(idx), ref_forward(model, idx)
    assert torch.allclose(got, want, atol=2e-4, rtol=1e-4), (got - want).abs().max()


def test_reference_notices_a_changed_switch() -> None:
    """The reference is not vacuous: the same weights under another switch give other logits."""
    model = build(small(mlp="gelu"))
    idx = torch.randint(0, 128, (1, 9))
    other = Transformer(small(mlp="gelu_exact"))
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(ref_forward(other, idx), model(idx), atol=1e-5)


# ---- accounting --------------------------------------------------------------------------------


def measured_breakdown(model: Transformer) -> dict[str, int]:
    """The module's parameters by component; a fused input projection split into its two parts."""
    out = dict.fromkeys(PARAM_COMPONENTS, 0)
    for name, p in model.named_parameters():
        if name.endswith(("in_proj.weight", "in_proj.bias")):
            block = model.blocks[int(name.split(".")[1])]
            qkv_share = block.attn.in_width * (p.numel() // p.size(0))
            out["attention"] += qkv_share
            out["mlp"] += p.numel() - qkv_share
        elif name.startswith(("wte.", "wpe.")):
            out["embeddings"] += p.numel()
        elif name.startswith("lm_head."):
            out["head"] += p.numel()
        elif "norm" in name:
            out["norms"] += p.numel()
        else:
            out["attention" if ".attn." in name else "mlp"] += p.numel()
    return out


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_parameter_accounting_equals_the_module(switches: dict[str, object]) -> None:
    cfg = small(**switches, tie_embeddings=False)
    model = Transformer(cfg)
    assert cfg.param_breakdown() == measured_breakdown(model)
    assert param_tensor_count(cfg) == len(list(model.parameters()))


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_flops_equal_torch_flop_counter(switches: dict[str, object]) -> None:
    """Matmul FLOPs of the module (math attention: full T×T scores) equal the formula, forward
    and forward + backward (the head's in-place gradient matmul counted as test_accounting's)."""
    from torch.utils.flop_counter import FlopCounterMode

    from tests.model.test_accounting import IN_PLACE_ADDMM

    cfg = small(**switches, attention_backend="math")
    model = Transformer(cfg)
    B, T = 2, 32
    x = torch.randint(0, cfg.vocab_size, (B, T))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x, x)
    assert counter.get_total_flops() == B * T * flop_count(cfg, T).forward
    with FlopCounterMode(display=False, custom_mapping=IN_PLACE_ADDMM) as counter:
        model(x, x).backward()
    assert (
        counter.get_total_flops()
        == B * T * flop_count(cfg, T).total
        == B * T * cfg.flops_per_token(T)
    )


def test_gated_widths_follow_the_two_thirds_rule() -> None:
    for kind in ("swiglu", "geglu"):
        cfg = ModelConfig(n_embd=96, n_head=4, mlp=kind, ff_multiple=1)
        assert cfg.ff_size == 256  # 2/3 · 4 · 96
        assert mlp_params(cfg, False) == mlp_params(ModelConfig(n_embd=96, n_head=4), False)
    assert ModelConfig(n_embd=96, n_head=4, mlp="relu2").ff_size == 384


def test_partial_rope_leaves_the_other_dims_unrotated() -> None:
    """Position-free dims: a query/key pair's score there is the same at every position."""
    cfg = small(rotary_fraction=0.5)
    assert cfg.rope_dim == cfg.head_size // 2
    model = build(cfg)
    attn = model.blocks[0].attn
    x = torch.randn(1, 8, cfg.n_embd).expand(1, 8, cfg.n_embd).clone()
    x[:] = x[:, :1]  # the same token at every position
    q, _, _ = attn.heads(x, (model.rope_cos[:8], model.rope_sin[:8]))
    tail = slice(cfg.rope_dim, None)
    assert torch.allclose(q[..., tail], q[..., :1, tail].expand_as(q[..., tail]))
    assert not torch.allclose(
        q[..., : cfg.rope_dim], q[..., :1, : cfg.rope_dim].expand_as(q[..., : cfg.rope_dim])
    )


def test_nope_and_sinusoidal_have_no_position_parameters() -> None:
    for pos in ("none", "sinusoidal"):
        model = Transformer(small(pos_emb=pos))
        assert model.wpe is None and "pos_table" not in model.state_dict()
    assert Transformer(small(pos_emb="none")).pos_table.numel() == 0


def test_depth_preset_sets_width_and_heads_from_one_knob() -> None:
    for depth in (2, 4, 12):
        cfg = ModelConfig.preset(f"depth-{depth}")
        assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.head_size) == (
            depth, 64 * depth, depth, 64,
        )  # fmt: skip
        assert cfg.mup_base_width is None
    mup = ModelConfig.preset("depth-8-mup", vocab_size=300)
    assert mup.mup_base_width == 256 and mup.width_mult == 2.0 and mup.vocab_size == 300


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mlp": "gelu2"}, "mlp must be one of 'gelu', 'gelu_exact', 'relu'"),
        ({"pos_emb": "alibi"}, "pos_emb must be one of"),
        ({"norm_placement": "middle"}, "norm_placement must be one of"),
        ({"rotary_fraction": 0.0}, "rotary_fraction must be in (0, 1]"),
        ({"rotary_fraction": 0.1}, "RoPE needs an even rotated width >= 2"),
        ({"parallel_norms": 3}, "parallel_norms must be 1 or 2"),
        ({"parallel_block": True, "norm_placement": "post"}, "parallel_block needs norm_placement"),
        ({"attn_softcap": -1.0}, "attn_softcap must be > 0"),
        ({"mup_base_width": 0}, "mup_base_width must be >= 1"),
    ],
)
def test_bad_switches_are_named(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        small(**overrides)
    with pytest.raises(ModelConfigError, match="depth preset must be depth-N"):
        ModelConfig.preset("depth-x")


@pytest.mark.parametrize("switches", [{"parallel_block": True}, {"attn_softcap": 1.0}])
def test_attention_maps_read_fused_and_soft_capped_layers(switches: dict[str, object]) -> None:
    from kiln.model.attention_maps import attention_maps

    model = build(small(**switches))
    idx = torch.randint(0, 128, (1, 9))
    maps = attention_maps(model, idx)
    assert len(maps) == 2 and maps[0].shape == (1, 4, 9, 9)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(1, 4, 9))
    assert maps[0].triu(1).abs().max() == 0  # causal
    if "attn_softcap" in switches:  # capped at ±1: no weight beyond e² times another's in a row
        row = maps[0][0, 0, -1]
        assert row.max() / row.min() <= math.exp(2) + 1e-4
