"""ModelConfig: every architectural choice as an orthogonal switch, presets as short data.

Parameter count and FLOPs per token are computed from the config alone (no torch) in
kiln/model/accounting.py, so planning tools can size a model without building it; `Transformer`
checks the count at start-up.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from kiln import config as cfgio
from kiln.config import ConfigError, require
from kiln.model import accounting

# "gelu" is the tanh approximation (GPT-2's gelu_new), as it always was in kiln; "gelu_exact" is
# erf-GELU. The gated kinds multiply an activated gate by an up projection (fused in one matrix).
ACTIVATIONS = ("gelu", "gelu_exact", "relu", "relu2", "swiglu", "geglu", "none")
GATED = ("swiglu", "geglu")
POSITIONS = ("learned", "rope", "sinusoidal", "none")
# A block's sequence mixer, by letter of `layer_pattern`: attention, Mamba-2 (SSD), Gated DeltaNet.
MIXERS = {"A": "attention", "M": "mamba2", "D": "deltanet"}
NORM_PLACEMENTS = ("pre", "post", "sandwich")


class ModelConfigError(ConfigError):
    """A model config that cannot describe a valid model; the message names the field."""


_require = functools.partial(require, error=ModelConfigError)


ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling for context extension, with HF's rope_type meanings (see kiln/model/rope.py).

    linear: positions / factor. dynamic: NTK-aware base growth once a sequence is longer than
    original_max_seq_len. yarn: per-frequency interpolation ramp (beta_fast..beta_slow) plus an
    attention temperature. llama3: long wavelengths / factor, smoothed between the two bands.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_seq_len: int = 8192
    type: str = "llama3"
    beta_fast: float = 32.0  # yarn: rotations above which a frequency is kept
    beta_slow: float = 1.0  # yarn: rotations below which it is interpolated
    mscale: float | None = None  # yarn: attention factor from mscale / mscale_all_dim...
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # ...unless given directly

    def __post_init__(self) -> None:
        """The interpolation divides by the factor and by high_freq_factor - low_freq_factor."""
        _require(
            self.type in ROPE_TYPES,
            f"rope_scaling.type must be one of {', '.join(ROPE_TYPES)}, got {self.type!r}",
        )
        _require(self.factor > 0, f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.type == "llama3":
            _require(
                0 < self.low_freq_factor < self.high_freq_factor,
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}",
            )
        _require(
            self.original_max_seq_len >= 1,
            f"rope_scaling.original_max_seq_len must be >= 1, got {self.original_max_seq_len}",
        )
        _require(
            self.beta_fast > self.beta_slow > 0,
            f"rope_scaling needs beta_fast > beta_slow > 0, got {self.beta_fast}, {self.beta_slow}",
        )


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs (kiln/model/moe.py): top-k routing over fine-grained experts."""

    n_experts: int = 8
    top_k: int = 2
    d_expert: int | None = None  # hidden width of one expert; None: the dense ff_size
    n_shared: int = 0  # always-on shared experts (one MLP n_shared·d_expert wide), DeepSeek-style
    score: str = "softmax"  # "softmax" over experts | "sigmoid" per expert (DeepSeek-V3)
    norm_topk: bool = True  # renormalise the k chosen weights to sum to one
    routed_scale: float = 1.0  # the routed experts' sum is scaled by this (DeepSeek's 2.5)
    first_dense: int = 0  # the first layers keep a dense MLP (DeepSeek's first_k_dense_replace)
    aux_loss: float = 0.0  # weight of the load-balancing loss E/(N·k)·Σ count_i·P_i
    router_z_loss: float = 0.0  # weight of mean(logsumexp(router logits)²)
    expert_bias: bool = False  # a routing bias used for the choice only (aux-loss-free balance)
    bias_update_rate: float = 0.0  # after each step bias += rate·sign(mean load - load)
    capacity_factor: float | None = None  # None: dropless; else each expert takes ≤ cf·N·k/E

    def __post_init__(self) -> None:
        """Reject settings that cannot route, naming the field."""
        _require(self.n_experts >= 1, f"moe.n_experts must be >= 1, got {self.n_experts}")
        _require(
            1 <= self.top_k <= self.n_experts,
            f"moe.top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}",
        )
        _require(
            self.d_expert is None or self.d_expert >= 1,
            f"moe.d_expert must be >= 1, got {self.d_expert}",
        )
        _require(self.n_shared >= 0, f"moe.n_shared must be >= 0, got {self.n_shared}")
        _require(
            self.score in ("softmax", "sigmoid"),
            f"moe.score must be 'softmax' or 'sigmoid', got {self.score!r}",
        )
        _require(self.first_dense >= 0, f"moe.first_dense must be >= 0, got {self.first_dense}")
        for name in ("aux_loss", "router_z_loss", "bias_update_rate"):
            _require(
                getattr(self, name) >= 0, f"moe.{name} must be >= 0, got {getattr(self, name)}"
            )
        _require(
            self.bias_update_rate == 0 or self.expert_bias,
            "moe.bias_update_rate needs moe.expert_bias = true",
        )
        _require(
            self.capacity_factor is None or self.capacity_factor > 0,
            f"moe.capacity_factor must be > 0 (or None for dropless), got {self.capacity_factor}",
        )


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, kiln/model/mla.py): keys and values from a
    low-rank latent, plus one small RoPE key shared by the heads; the cache holds only those two.
    """

    kv_rank: int = 64  # width of the compressed KV latent (kv_lora_rank)
    q_rank: int | None = None  # compress queries through this rank too (None: full-rank)
    rope_dim: int = 16  # per-head width of the decoupled RoPE query/key (qk_rope_head_dim)
    nope_dim: int | None = None  # per-head width of the position-free query/key; None: head_size
    v_dim: int | None = None  # per-head width of values; None: head_size

    def __post_init__(self) -> None:
        """Every width positive, the RoPE part even."""
        for name in ("kv_rank", "rope_dim"):
            _require(
                getattr(self, name) >= 1, f"mla.{name} must be >= 1, got {getattr(self, name)}"
            )
        for name in ("q_rank", "nope_dim", "v_dim"):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"mla.{name} must be >= 1, got {value}")
        _require(self.rope_dim % 2 == 0, f"mla.rope_dim must be even, got {self.rope_dim}")


@dataclass(frozen=True)
class SSMConfig:
    """Sizes of the recurrent mixers (kiln/model/ssm.py) that `layer_pattern` places.

    Mamba-2: inner width expand·n_embd in heads of head_dim, a state of state_size per head, B
    and C shared by n_groups groups of heads. Gated DeltaNet: delta_heads heads (None: n_head)
    with keys and values of delta_head_dim (None: head_size). Both run a causal depthwise conv
    of conv_kernel taps first and train in chunks of chunk_size (a speed knob, not a model one).
    """

    state_size: int = 64
    expand: int = 2
    head_dim: int = 64
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 64
    delta_heads: int | None = None
    delta_head_dim: int | None = None
    dt_min: float = 0.001  # Mamba-2's time steps start log-uniform in [dt_min, dt_max]...
    dt_max: float = 0.1
    dt_floor: float = 1e-4  # ...and no smaller than this

    def __post_init__(self) -> None:
        """Every size positive, the time-step range ordered."""
        for name in ("state_size", "expand", "head_dim", "n_groups", "conv_kernel", "chunk_size"):
            _require(
                getattr(self, name) >= 1, f"ssm.{name} must be >= 1, got {getattr(self, name)}"
            )
        for name in ("delta_heads", "delta_head_dim"):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"ssm.{name} must be >= 1, got {value}")
        _require(
            0 < self.dt_min <= self.dt_max,
            f"ssm needs 0 < dt_min <= dt_max, got {self.dt_min} and {self.dt_max}",
        )


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Transformer LM; the defaults are GPT-2 124M exactly as released."""

    vocab_size: int = 50257  # real token ids: inputs, targets and returned logits use only these
    vocab_multiple: int = 1  # embedding/head rows padded up to a multiple (64/128: fast matmuls)
    block_size: int = 1024  # longest sequence the model accepts
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None  # None: = n_head (multi-head); 1: multi-query
    n_embd: int = 768
    head_dim: int | None = None  # None: n_embd // n_head
    mlp: str = (
        "gelu"  # ACTIVATIONS: "gelu" (tanh), "gelu_exact", "relu", "relu2", "swiglu", "geglu"
    )
    d_ff: int | None = None  # None: 4·n_embd; gated (swiglu, geglu): 2/3 of that, rounded
    ff_multiple: int = 1  # a derived SwiGLU width is rounded up to this multiple
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    norm_eps: float = 1e-5
    bias: bool = True  # biases in every linear layer and LayerNorm
    pos_emb: str = "learned"  # "learned" | "rope" (HF split-half) | "sinusoidal" | "none" (NoPE)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = True  # LM head shares the token embedding's storage
    qk_norm: bool = False  # normalise queries and keys per head before RoPE
    z_loss: float = 0.0  # weight of mean(logsumexp(logits)²) added to the loss
    logit_softcap: float | None = None  # logits -> c·tanh(logits / c)
    sliding_window: int | None = None  # keys further back than this are masked...
    window_pattern: str = "L"  # ...in layers marked L; G layers are global; cycled over layers
    attention_backend: str = "sdpa"  # "sdpa" | "math" (the textbook formula) | "triton"
    dropout: float = 0.0
    init_std: float = 0.02
    moe: MoEConfig | None = None  # mixture-of-experts MLPs (None: dense)
    mla: MLAConfig | None = None  # multi-head latent attention (None: GQA / MHA)
    attn_sinks: bool = False  # a learned sink logit per head in every softmax (gpt-oss)
    rotary_fraction: float = 1.0  # partial RoPE: the first fraction of each head's dims rotate
    norm_placement: str = "pre"  # "pre" | "post" (original Transformer) | "sandwich" (Gemma 2)
    norm_scale: bool = True  # norms carry a learnable scale (and LayerNorm its bias if `bias`)
    parallel_block: bool = False  # x + attn(n(x)) + mlp(n(x)) (GPT-J / PaLM / GPT-NeoX)
    parallel_norms: int = 1  # 1: one shared norm, input projections fused; 2: one each (NeoX)
    embed_scale: bool = False  # token embeddings × √n_embd (original Transformer, Gemma)
    attn_scale: float | None = None  # query-key scale; None: 1/√head_dim (µP: √D₀/D, see below)
    attn_softcap: float | None = None  # attention scores -> c·tanh(s / c) (Gemma 2)
    mup_base_width: int | None = None  # µP relative to this n_embd (kiln/train/mup.py); None: SP
    layer_pattern: str = "A"  # mixers by letter (MIXERS), cycled over layers: "DDDA" is 3:1 hybrid
    ssm: SSMConfig = SSMConfig()  # sizes of the Mamba-2 ("M") and Gated DeltaNet ("D") mixers

    def __post_init__(self) -> None:
        """Reject configs that cannot build a model, naming the field and what was expected."""
        for name in ("vocab_size", "vocab_multiple", "block_size", "n_layer", "n_head", "n_embd"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _one_of("mlp", self.mlp, ACTIVATIONS)
        _one_of("pos_emb", self.pos_emb, POSITIONS)
        _one_of("norm_placement", self.norm_placement, NORM_PLACEMENTS)
        _require(
            self.norm in ("layernorm", "rmsnorm"),
            f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}",
        )
        _require(
            self.attention_backend in ("sdpa", "math", "triton"),
            f"attention_backend must be 'sdpa', 'math' or 'triton', got {self.attention_backend!r}",
        )
        if self.head_dim is None:
            _require(
                self.n_embd % self.n_head == 0,
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}), "
                "or set head_dim explicitly",
            )
        _require(self.kv_heads >= 1, f"n_kv_head must be >= 1, got {self.n_kv_head}")
        _require(
            self.n_head % self.kv_heads == 0,
            f"n_kv_head ({self.kv_heads}) must divide n_head ({self.n_head})",
        )
        _require(self.head_size >= 1, f"head_dim must be >= 1, got {self.head_dim}")
        _require(
            0 < self.rotary_fraction <= 1,
            f"rotary_fraction must be in (0, 1], got {self.rotary_fraction}",
        )
        if self.pos_emb == "rope":
            _require(
                self.rope_dim % 2 == 0 and self.rope_dim >= 2,
                f"RoPE needs an even rotated width >= 2, got {self.rope_dim} (head_dim "
                f"{self.head_size} × rotary_fraction {self.rotary_fraction})",
            )
        if self.pos_emb == "sinusoidal":
            _require(
                self.n_embd % 2 == 0, f"sinusoidal positions need an even n_embd, got {self.n_embd}"
            )
        _require(
            self.parallel_norms in (1, 2),
            f"parallel_norms must be 1 or 2, got {self.parallel_norms}",
        )
        _require(
            not self.parallel_block or self.norm_placement == "pre",
            f"parallel_block needs norm_placement = 'pre', got {self.norm_placement!r}",
        )
        for name in ("attn_scale", "attn_softcap"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"{name} must be > 0 (or None), got {value}")
        _require(
            self.mup_base_width is None or self.mup_base_width >= 1,
            f"mup_base_width must be >= 1 (or None for standard parameterisation), got "
            f"{self.mup_base_width}",
        )
        _require(self.d_ff is None or self.d_ff >= 1, f"d_ff must be >= 1, got {self.d_ff}")
        _require(self.ff_multiple >= 1, f"ff_multiple must be >= 1, got {self.ff_multiple}")
        _require(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
        _require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        _require(self.z_loss >= 0, f"z_loss must be >= 0, got {self.z_loss}")
        _require(
            self.logit_softcap is None or self.logit_softcap > 0,
            f"logit_softcap must be > 0 (or None for off), got {self.logit_softcap}",
        )
        _require(
            self.sliding_window is None or self.sliding_window >= 1,
            f"sliding_window must be >= 1 (or None for off), got {self.sliding_window}",
        )
        _require(
            len(self.window_pattern) >= 1 and set(self.window_pattern) <= {"L", "G"},
            f"window_pattern must be a non-empty string of 'L' and 'G', got {self.window_pattern!r}",
        )
        _require(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        _require(self.init_std > 0, f"init_std must be > 0, got {self.init_std}")
        _require(
            self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling),
            f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r} "
            "(plain data goes through ModelConfig.from_dict)",
        )
        if self.mla is not None:
            _require(self.pos_emb == "rope", "mla needs pos_emb = 'rope' (its decoupled RoPE key)")
            _require(not self.qk_norm, "mla and qk_norm cannot be combined (MLA norms its latents)")
        self._check_mixers()
        if self.moe is not None:
            _require(
                self.moe.first_dense <= self.n_layer,
                f"moe.first_dense ({self.moe.first_dense}) exceeds n_layer ({self.n_layer})",
            )

    def _check_mixers(self) -> None:
        """The layer pattern's letters, and what the recurrent mixers and mlp = 'none' need."""
        _require(
            len(self.layer_pattern) >= 1 and set(self.layer_pattern) <= set(MIXERS),
            f"layer_pattern must be a non-empty string of {', '.join(MIXERS)} "
            f"({', '.join(f'{k}: {v}' for k, v in MIXERS.items())}), got {self.layer_pattern!r}",
        )
        _require(
            isinstance(self.ssm, SSMConfig),
            f"ssm must be an SSMConfig, got {self.ssm!r} (plain data goes through from_dict)",
        )
        if self.mlp == "none":
            _require(
                self.norm_placement == "pre" and not self.parallel_block and self.moe is None,
                "mlp = 'none' (mixer-only blocks, as Mamba-2) needs norm_placement = 'pre', "
                "parallel_block = false and no moe",
            )
        if not self.has_recurrent_layers:
            return
        _require(
            not self.parallel_block,
            f"layer_pattern {self.layer_pattern!r} has recurrent mixers; they have no parallel "
            "block form (parallel_block = false)",
        )
        s = self.ssm
        if "M" in self.layer_pattern:
            inner = s.expand * self.n_embd
            _require(
                inner % s.head_dim == 0,
                f"ssm.head_dim ({s.head_dim}) must divide the Mamba-2 inner width expand·n_embd "
                f"({inner})",
            )
            _require(
                (inner // s.head_dim) % s.n_groups == 0,
                f"ssm.n_groups ({s.n_groups}) must divide the Mamba-2 heads ({inner // s.head_dim})",
            )

    # ---- derived sizes -------------------------------------------------------------------------

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (grouped-query attention when < n_head)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_size(self) -> int:
        """Width of one attention head."""
        return self.n_embd // self.n_head if self.head_dim is None else self.head_dim

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and LM head: vocab_size rounded up to vocab_multiple."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def gated(self) -> bool:
        """Whether the MLP is gated (SwiGLU, GeGLU): three matrices, gate and up fused."""
        return self.mlp in GATED

    @property
    def ff_size(self) -> int:
        """Hidden width of the MLP."""
        if self.d_ff is not None:
            return self.d_ff
        if not self.gated:
            return 4 * self.n_embd
        hidden = int(2 * 4 * self.n_embd / 3)  # a gated MLP's 3 matrices cost what 2 do at 4x
        return -(-hidden // self.ff_multiple) * self.ff_multiple

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates per head: MLA's decoupled part, else rotary_fraction of the head."""
        return (
            self.mla.rope_dim
            if self.mla is not None
            else int(self.head_size * self.rotary_fraction)
        )

    @property
    def width_mult(self) -> float:
        """µP's width multiplier n_embd / mup_base_width (1 under standard parameterisation)."""
        return 1.0 if self.mup_base_width is None else self.n_embd / self.mup_base_width

    @property
    def attention_scale(self) -> float | None:
        """The query-key scale attention uses; None: 1/√D.

        µP scales by 1/D rather than 1/√D: √D₀/D with D₀ = D / width_mult, the head width at the
        base width, so it equals 1/√D₀ there (heads kept fixed as width grows).
        """
        if self.attn_scale is not None or self.mup_base_width is None:
            return self.attn_scale
        return 1.0 / (self.qk_head_dim * self.width_mult) ** 0.5

    @property
    def norms_per_block(self) -> int:
        """Norm layers in one block: 2, 4 with sandwich norms, 1 in a shared-norm parallel block."""
        if self.norm_placement == "sandwich":
            return 4
        if not self.has_mlp:
            return 1
        return 1 if self.parallel_block and self.parallel_norms == 1 else 2

    @property
    def fused_input(self) -> bool:
        """Whether a layer's QKV and MLP input projections are one matrix (shared-norm parallel)."""
        return self.parallel_block and self.parallel_norms == 1 and self.mla is None

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys (MLA: position-free part + RoPE part)."""
        if self.mla is None:
            return self.head_size
        return (self.mla.nope_dim or self.head_size) + self.mla.rope_dim

    @property
    def v_head_dim(self) -> int:
        """Per-head width of values."""
        return self.head_size if self.mla is None else self.mla.v_dim or self.head_size

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(heads, key width, value width) one layer caches per token.

        MLA caches its latent as the "key" and the shared RoPE key as the "value" of one head.
        """
        if self.mla is not None:
            return 1, self.mla.kv_rank, self.mla.rope_dim
        return self.kv_heads, self.head_size, self.head_size

    def kv_cache_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """KV-cache bytes one token costs over all layers (bf16 by default)."""
        heads, k_dim, v_dim = self.kv_cache_dims
        return self.n_layer * heads * (k_dim + v_dim) * bytes_per_value

    @property
    def expert_size(self) -> int:
        """Hidden width of one routed expert."""
        return self.ff_size if self.moe is None or self.moe.d_expert is None else self.moe.d_expert

    def is_moe_layer(self, layer: int) -> bool:
        """Whether this layer's MLP is a mixture of experts."""
        return self.moe is not None and layer >= self.moe.first_dense

    def layer_mixer(self, layer: int) -> str:
        """This layer's sequence mixer: "attention", "mamba2" or "deltanet" (see MIXERS)."""
        return MIXERS[self.layer_pattern[layer % len(self.layer_pattern)]]

    @property
    def has_recurrent_layers(self) -> bool:
        """Whether some layer is a Mamba-2 or Gated DeltaNet mixer (a recurrent state to carry)."""
        return any(self.layer_mixer(i) != "attention" for i in range(self.n_layer))

    @property
    def has_mlp(self) -> bool:
        """Whether blocks have an MLP after the mixer (mlp = 'none': mixer-only, as Mamba-2)."""
        return self.mlp != "none"

    @property
    def mamba_inner(self) -> int:
        """Mamba-2's inner width (expand·n_embd), split into mamba_heads heads of ssm.head_dim."""
        return self.ssm.expand * self.n_embd

    @property
    def mamba_heads(self) -> int:
        """Number of Mamba-2 heads."""
        return self.mamba_inner // self.ssm.head_dim

    @property
    def delta_heads(self) -> int:
        """Number of Gated DeltaNet heads."""
        return self.ssm.delta_heads or self.n_head

    @property
    def delta_head_dim(self) -> int:
        """Gated DeltaNet's key and value width per head."""
        return self.ssm.delta_head_dim or self.head_size

    def layer_window(self, layer: int) -> int | None:
        """Sliding-window size of one layer, or None when it attends to the whole prefix."""
        if self.sliding_window is None:
            return None
        is_local = self.window_pattern[layer % len(self.window_pattern)] == "L"
        return self.sliding_window if is_local else None

    # ---- accounting (kiln/model/accounting.py holds the counts; these are its common calls) -------

    def param_breakdown(self, active: bool = False) -> dict[str, int]:
        """Parameters of the module by component (`accounting.param_breakdown`)."""
        return accounting.param_breakdown(self, active)

    def num_params(self) -> int:
        """Parameters of the module (a tied head counted once; padded vocab rows included)."""
        return accounting.num_params(self)

    def num_active_params(self) -> int:
        """Parameters one token uses: `num_params` less the routed experts it is not sent to."""
        return accounting.num_active_params(self)

    def num_matmul_params(self) -> int:
        """Weights used in a matrix multiply per token (`accounting.num_matmul_params`)."""
        return accounting.num_matmul_params(self)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token (`accounting.flops_per_token`)."""
        return accounting.flops_per_token(self, seq_len)

    # ---- plain data (kiln/config.py's typed reader and writer, like every config section) --------

    def to_dict(self) -> dict[str, Any]:
        """Plain data (rope_scaling as a table), for TOML via `kiln.config.to_toml` or JSON."""
        return cfgio.to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "model") -> ModelConfig:
        """Build from plain data, every value type-checked; an unknown key is named."""
        return cfgio.from_dict(cls, data, where)

    # ---- presets ---------------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset (see `PRESETS`), with optional field overrides."""
        if name.startswith("depth-"):
            return cls.from_dict({**depth_preset(name), **overrides})
        if name not in PRESETS:
            raise ModelConfigError(
                f"unknown model preset {name!r}; known: {', '.join(PRESETS)}, depth-N, depth-N-mup"
            )
        return cls.from_dict({**PRESETS[name], **overrides})


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    """Reject a string switch outside its allowed values, naming them."""
    _require(
        value in allowed, f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}"
    )


# GPT-2 is the dataclass default; the Llama-style family swaps every switch at once.
_LLAMA: dict[str, Any] = dict(
    pos_emb="rope",
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
    rope_theta=500000.0,
    ff_multiple=256,
    vocab_size=32768,
    vocab_multiple=128,
    block_size=2048,
    tie_embeddings=True,
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {**_LLAMA, "vocab_size": 512, "block_size": 128, "n_layer": 2, "n_head": 4,
             "n_kv_head": 2, "n_embd": 64, "ff_multiple": 32},
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "n_embd": 768},
    "gpt2-350m": {"n_layer": 24, "n_head": 16, "n_embd": 1024},
    "gpt2-774m": {"n_layer": 36, "n_head": 20, "n_embd": 1280},
    "gpt2-1.5b": {"n_layer": 48, "n_head": 25, "n_embd": 1600},
    "llama-20m": {**_LLAMA, "n_layer": 6, "n_head": 6, "n_kv_head": 2, "n_embd": 384},
    "llama-100m": {**_LLAMA, "n_layer": 12, "n_head": 12, "n_kv_head": 4, "n_embd": 768},
    "llama-300m": {**_LLAMA, "n_layer": 24, "n_head": 16, "n_kv_head": 4, "n_embd": 1024},
    "llama-1b": {**_LLAMA, "n_layer": 16, "n_head": 32, "n_kv_head": 8, "n_embd": 2048,
                 "d_ff": 8192, "vocab_size": 128256, "norm_eps": 1e-5, "block_size": 131072,
                 "rope_scaling": {"factor": 32.0, "original_max_seq_len": 8192}},
    # llama-20m with 8 experts of half its MLP width, top-2: the same active parameters.
    "moe-20m": {**_LLAMA, "n_layer": 6, "n_head": 6, "n_kv_head": 2, "n_embd": 384,
                "moe": {"n_experts": 8, "top_k": 2, "d_expert": 512, "aux_loss": 0.01}},
    # llama-20m with multi-head latent attention: 160 cached numbers per token and layer, not 256.
    "mla-20m": {**_LLAMA, "n_layer": 6, "n_head": 6, "n_embd": 384,
                "mla": {"kv_rank": 128, "rope_dim": 32}},
}  # fmt: skip
# "llama-1b" is Llama-3.2-1B's shape (1,235,814,400 parameters), so HF checkpoints map onto it.


# ---- the depth-derived family: one knob (`depth-N`) sets depth, width and heads ----------------
# nanochat's idea: instead of editing n_layer, n_embd, n_head (and the learning rates) together,
# derive them from the depth at a fixed aspect ratio. `depth-N-mup` adds µP relative to depth 4,
# so learning rates tuned there carry to any depth-N (kiln/train/mup.py derives each group's).

DEPTH_ASPECT = 64  # n_embd per layer in the depth family (nanochat's aspect ratio)
DEPTH_HEAD_DIM = 64
DEPTH_MUP_BASE = 4  # depth-N-mup: µP relative to depth 4's width (256)


def depth_preset(name: str) -> dict[str, Any]:
    """The config fields of `depth-N` (or `depth-N-mup`): N layers, width 64·N, heads of 64."""
    body = name.removeprefix("depth-").removesuffix("-mup")
    _require(
        body.isdigit() and int(body) >= 1,
        f"depth preset must be depth-N or depth-N-mup with N >= 1, got {name!r}",
    )
    depth = int(body)
    width = DEPTH_ASPECT * depth
    out = {**_LLAMA, "n_layer": depth, "n_embd": width, "n_head": width // DEPTH_HEAD_DIM}
    if name.endswith("-mup"):
        out["mup_base_width"] = DEPTH_ASPECT * DEPTH_MUP_BASE
    return out
