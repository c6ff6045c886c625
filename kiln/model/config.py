"""ModelConfig: every architectural choice as an orthogonal switch, presets as short data.

Parameter count and FLOPs per token are computed here from the config alone (no torch), so
planning tools can size a model without building it; `Transformer` checks the count at start-up.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from kiln import config as cfgio
from kiln.config import ConfigError, require

PARAM_COMPONENTS = ("embeddings", "attention", "mlp", "norms", "head")


class ModelConfigError(ConfigError):
    """A model config that cannot describe a valid model; the message names the field."""


_require = functools.partial(require, error=ModelConfigError)


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling for context extension (HF rope_type "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        """The interpolation divides by the factor and by high_freq_factor - low_freq_factor."""
        _require(self.factor > 0, f"rope_scaling.factor must be > 0, got {self.factor}")
        _require(
            0 < self.low_freq_factor < self.high_freq_factor,
            "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
            f"{self.low_freq_factor} and {self.high_freq_factor}",
        )
        _require(
            self.original_max_seq_len >= 1,
            f"rope_scaling.original_max_seq_len must be >= 1, got {self.original_max_seq_len}",
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
    mlp: str = "gelu"  # "gelu" (tanh approximation) | "swiglu"
    d_ff: int | None = None  # None: 4·n_embd for gelu, Llama's 8/3·n_embd rounded for swiglu
    ff_multiple: int = 1  # a derived SwiGLU width is rounded up to this multiple
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    norm_eps: float = 1e-5
    bias: bool = True  # biases in every linear layer and LayerNorm
    pos_emb: str = "learned"  # "learned" absolute positions | "rope" (HF split-half convention)
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

    def __post_init__(self) -> None:
        """Reject configs that cannot build a model, naming the field and what was expected."""
        for name in ("vocab_size", "vocab_multiple", "block_size", "n_layer", "n_head", "n_embd"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _require(
            self.mlp in ("gelu", "swiglu"), f"mlp must be 'gelu' or 'swiglu', got {self.mlp!r}"
        )
        _require(
            self.norm in ("layernorm", "rmsnorm"),
            f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}",
        )
        _require(
            self.pos_emb in ("learned", "rope"),
            f"pos_emb must be 'learned' or 'rope', got {self.pos_emb!r}",
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
        if self.pos_emb == "rope":
            _require(self.head_size % 2 == 0, f"RoPE needs an even head_dim, got {self.head_size}")
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
    def ff_size(self) -> int:
        """Hidden width of the MLP."""
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "gelu":
            return 4 * self.n_embd
        hidden = int(2 * 4 * self.n_embd / 3)  # SwiGLU's 3 matrices cost what GELU's 2 do at 4x
        return -(-hidden // self.ff_multiple) * self.ff_multiple

    def layer_window(self, layer: int) -> int | None:
        """Sliding-window size of one layer, or None when it attends to the whole prefix."""
        if self.sliding_window is None:
            return None
        is_local = self.window_pattern[layer % len(self.window_pattern)] == "L"
        return self.sliding_window if is_local else None

    # ---- accounting ------------------------------------------------------------------------------

    def param_breakdown(self) -> dict[str, int]:
        """Parameters of the module by component (PARAM_COMPONENTS); a tied head counts 0.

        The one parameter count: `num_params` is its sum, `kiln scaling account` prints it, and
        `Transformer` checks it against the instantiated module.
        """
        d, L = self.n_embd, self.n_layer
        norm_scale = 2 if self.norm == "layernorm" and self.bias else 1  # weight (+ bias)
        norms = 2 * norm_scale * d + (2 * norm_scale * self.head_size if self.qk_norm else 0)
        return {
            "embeddings": self.padded_vocab_size * d
            + (self.block_size * d if self.pos_emb == "learned" else 0),
            "attention": L * self._attention_params(self.bias),
            "mlp": L * self._mlp_params(self.bias),
            "norms": L * norms + norm_scale * d,  # every block's two (+ q/k norms), the final one
            "head": 0 if self.tie_embeddings else self.padded_vocab_size * d,
        }

    def num_params(self) -> int:
        """Parameters of the module (a tied head counted once; padded vocab rows included)."""
        return sum(self.param_breakdown().values())

    def num_matmul_params(self) -> int:
        """Weights used in a matrix multiply per token: every block's linear layers and the head."""
        layer = self._attention_params(bias=False) + self._mlp_params(bias=False)
        return self.n_layer * layer + self.padded_vocab_size * self.n_embd

    def _attention_params(self, bias: bool) -> int:
        """One block's QKV and output projections (with their biases if `bias`)."""
        d, q_out, kv_out = self.n_embd, self.n_head * self.head_size, self.kv_heads * self.head_size
        weights = d * (q_out + 2 * kv_out) + q_out * d
        return weights + (q_out + 2 * kv_out + d if bias else 0)

    def _mlp_params(self, bias: bool) -> int:
        """One block's MLP: fused gate+up (SwiGLU) or fc, then proj (with their biases if `bias`)."""
        d, ff = self.n_embd, self.ff_size
        n_in = 2 if self.mlp == "swiglu" else 1
        return (n_in + 1) * d * ff + (n_in * ff + d if bias else 0)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token: 6·N_matmul + 12·L·H·head_dim·T.

        The attention term counts the full T×T score matrix (the PaLM / nanoGPT convention, no
        causal or window discount), so MFU figures compare across implementations.
        """
        attn = 12 * self.n_layer * self.n_head * self.head_size * seq_len
        return 6 * self.num_matmul_params() + attn

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
        if name not in PRESETS:
            raise ModelConfigError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


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
}  # fmt: skip
# "llama-1b" is Llama-3.2-1B's shape (1,235,814,400 parameters), so HF checkpoints map onto it.
