"""`kiln export RUN --gguf OUT.gguf`: a checkpoint as one GGUF file that llama.cpp loads.

The file holds the weights under llama.cpp's tensor names (the Llama-style family as `llama`,
GPT-2 as `gpt2`), the hyper-parameters it reads, and the tokenizer: byte-level BPE tokens as
GPT-2 unicode strings, the merges, pre-tokenizer "gpt-2" (llama.cpp's name for GPT-2's split
pattern, kiln's default), token types (special tokens are control tokens), eos/bos and the chat
template when the tokenizer has the chat tokens. Written with the `gguf` package (the
`gguf` extra) to a temporary name beside OUT and renamed, so OUT never holds half a file.

llama.cpp's RoPE (mode 0) rotates adjacent pairs, kiln's (and HF's) the two halves of a head,
so Q and K rows are permuted into pairs here; the values they produce are the same.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln import __version__
from kiln.chat import chat_template_of
from kiln.errors import KilnError
from kiln.io import check_can_write
from kiln.model.config import ModelConfig
from kiln.model.hf.convert import config_to_hf
from kiln.model.transformer import Transformer
from kiln.tokenizer.byte_unicode import bytes_to_token_string
from kiln.tokenizer.tokenizer import Tokenizer
from kiln.train.gguf_mixture import Fallback, describe_plan, encode, q4_k_m_plan

# f32 and f16 keep every matrix; q8_0 and q4_0 are gguf's own quantizers (32-weight blocks);
# q4_k_m is llama.cpp's Q4_K / Q6_K mixture, quantized by kiln.quant.kquants (kiln.train.gguf_mixture).
QUANTS = ("f32", "f16", "q8_0", "q4_0", "q4_k_m")
# Token types as llama.cpp reads them (gguf.TokenType): 1 normal, 3 control, 5 unused.
NORMAL, CONTROL, UNUSED = 1, 3, 5


@dataclass
class GGUFResult:
    """What `export_gguf` wrote, for the CLI to report."""

    out: Path
    arch: str
    quant: str
    tensors: int
    vocab: int
    bytes: int
    chat_template: bool
    types: dict[str, str] = field(default_factory=dict)  # tensor name -> GGML type written
    fallbacks: list[Fallback] = field(default_factory=list)  # q4_k_m rows not a multiple of 256


def check_quant(quant: str) -> None:
    """Refuse, in one line, a --quant value kiln does not write."""
    if quant not in QUANTS:
        raise KilnError(f"--quant {quant!r}: expected one of {', '.join(QUANTS)}")


def _gguf() -> Any:
    """The gguf package, or one line saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise KilnError(
            "--gguf needs the gguf package: pip install -e '.[gguf]' (or pip install gguf)"
        ) from None
    return gguf


def gguf_arch(cfg: ModelConfig) -> str:
    """llama.cpp's architecture name for a config ("llama" or "gpt2"), or a one-line refusal."""
    if cfg.moe is not None or cfg.mla is not None or cfg.has_recurrent_layers:
        kind = "experts (MoE)" if cfg.moe is not None else "MLA" if cfg.mla else "recurrent layers"
        raise KilnError(f"--gguf: no llama.cpp mapping for {kind}; kiln writes llama and gpt2 only")
    model_type = config_to_hf(cfg)["model_type"]  # refuses switches neither family has
    if model_type not in ("llama", "gpt2"):
        raise KilnError(f"--gguf: no llama.cpp mapping for {model_type}; llama and gpt2 only")
    if model_type == "llama" and (cfg.bias or cfg.rope_scaling is not None):
        raise KilnError("--gguf: Llama with bias or RoPE scaling is not supported")
    return model_type


# ---- the tokenizer -----------------------------------------------------------------------------


def gguf_vocab(tok: Tokenizer, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens (GPT-2 strings; specials by name), their types and the merges, `vocab_size` long.

    Ids the model has beyond the tokenizer's (a padded or larger embedding) become unused tokens.
    """
    names = {i: s for s, i in tok.special_tokens.items()}
    top = max([*tok.vocab, *names], default=-1) + 1
    if top > vocab_size:
        raise KilnError(
            f"tokenizer has ids up to {top - 1}; the model's vocab_size is {vocab_size}"
        )
    tokens, types = [], []
    for i in range(vocab_size):
        if i in names:
            tokens.append(names[i])
            types.append(CONTROL)
        elif i in tok.vocab:
            tokens.append(bytes_to_token_string(tok.vocab[i]))
            types.append(NORMAL)
        else:
            tokens.append(f"[UNUSED_{i}]")
            types.append(UNUSED)
    merges = [f"{bytes_to_token_string(a)} {bytes_to_token_string(b)}" for a, b in tok.merges]
    return tokens, types, merges


def _add_tokenizer(w: Any, tok: Tokenizer, vocab_size: int, eos_id: int) -> bool:
    """Tokenizer metadata; returns whether a chat template was written."""
    if tok.pattern.name != "gpt2":
        raise KilnError(
            f"--gguf: the tokenizer splits with the {tok.pattern.name!r} pattern; llama.cpp's "
            "pre-tokenizer is written as 'gpt-2', so only GPT-2's pattern is exported"
        )
    tokens, types, merges = gguf_vocab(tok, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # llama.cpp's name for GPT-2's split pattern
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eos_id)  # kiln has no separate bos: documents start after an eot
    w.add_eos_token_id(eos_id)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    template = chat_template_of(tok)
    if template is not None:
        w.add_chat_template(template.jinja)
    return template is not None


# ---- the weights ---------------------------------------------------------------------------------


def _pairs(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of each head reordered from split halves (x0..x_{d/2}, y0..) to pairs (x0, y0, ...)."""
    rows, cols = w.shape
    d = rows // n_heads
    return w.reshape(n_heads, 2, d // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_tensors(cfg: ModelConfig, sd: dict[str, torch.Tensor], arch: str) -> dict[str, np.ndarray]:
    """kiln's weights as float32 arrays under llama.cpp's tensor names (PyTorch row-major)."""
    a = {k: v.detach().float().cpu().numpy() for k, v in sd.items()}
    v = cfg.vocab_size
    out = {"token_embd.weight": a["wte.weight"][:v], "output_norm.weight": a["norm_f.weight"]}
    if not cfg.tie_embeddings:
        out["output.weight"] = a["lm_head.weight"][:v]
    if arch == "gpt2":
        out["position_embd.weight"] = a["wpe.weight"]
        names = {"norm1": "attn_norm", "attn.qkv": "attn_qkv", "attn.proj": "attn_output",
                 "norm2": "ffn_norm", "mlp.fc": "ffn_up", "mlp.proj": "ffn_down"}  # fmt: skip
        for key in ("norm_f.bias",):
            if key in a:
                out["output_norm.bias"] = a[key]
        for i in range(cfg.n_layer):
            for kiln_name, name in names.items():
                for kind in ("weight", "bias"):
                    if f"blocks.{i}.{kiln_name}.{kind}" in a:
                        out[f"blk.{i}.{name}.{kind}"] = a[f"blocks.{i}.{kiln_name}.{kind}"]
        return out
    q_out, kv_out = cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size
    for i in range(cfg.n_layer):
        k, b = f"blocks.{i}.", f"blk.{i}."
        q, kk, vv = np.split(a[k + "attn.qkv.weight"], [q_out, q_out + kv_out])
        gate, up = np.split(a[k + "mlp.fc.weight"], 2)
        out.update({
            b + "attn_norm.weight": a[k + "norm1.weight"],
            b + "attn_q.weight": _pairs(q, cfg.n_head),
            b + "attn_k.weight": _pairs(kk, cfg.kv_heads),
            b + "attn_v.weight": vv,
            b + "attn_output.weight": a[k + "attn.proj.weight"],
            b + "ffn_norm.weight": a[k + "norm2.weight"],
            b + "ffn_gate.weight": gate,
            b + "ffn_up.weight": up,
            b + "ffn_down.weight": a[k + "mlp.proj.weight"],
        })  # fmt: skip
    return out


def _add_hparams(w: Any, cfg: ModelConfig, arch: str) -> None:
    """The hyper-parameters llama.cpp reads for `arch`."""
    w.add_context_length(cfg.block_size)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.ff_size)
    w.add_head_count(cfg.n_head)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "gpt2":
        w.add_layer_norm_eps(cfg.norm_eps)
        return
    w.add_head_count_kv(cfg.kv_heads)
    w.add_rope_dimension_count(cfg.head_size)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_key_length(cfg.head_size)
    w.add_value_length(cfg.head_size)


def _plan(
    tensors: dict[str, np.ndarray], quant: str, n_layer: int
) -> tuple[dict[str, str], list[Fallback]]:
    """Each tensor's GGML type (1-D tensors stay f32, as llama.cpp's converter keeps them)."""
    if quant == "q4_k_m":
        return q4_k_m_plan({k: v.shape for k, v in tensors.items()}, n_layer)
    types = {}
    for name, array in tensors.items():
        if array.ndim == 1 or quant == "f32":
            types[name] = "F32"
        elif quant == "f16" or array.shape[-1] % 32:  # a row that does not fill whole blocks
            types[name] = "F16"
        else:
            types[name] = quant.upper()
    return types, []


FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0",
              "q4_k_m": "MOSTLY_Q4_K_M"}  # fmt: skip


def _bar(total: int, show: bool) -> Any:
    """A tqdm bar over the weights quantized (rate and ETA), shown on a terminal only."""
    from tqdm import tqdm

    return tqdm(total=total, unit="weight", unit_scale=True, desc="quantize",
                disable=None if show else True, leave=False)  # fmt: skip


def export_gguf(
    model: Transformer,
    tok: Tokenizer,
    eos_token: str,
    out: str | Path,
    quant: str = "f16",
    force: bool = False,
    name: str = "kiln",
    progress: bool = False,
) -> GGUFResult:
    """Write `model` and `tok` as one GGUF file `out` (whole or not at all)."""
    check_quant(quant)
    out = Path(out)
    check_can_write(out, force)
    gguf = _gguf()
    cfg = model.cfg
    arch = gguf_arch(cfg)
    if eos_token not in tok.special_tokens:
        raise KilnError(f"tokenizer has no special token {eos_token!r} to use as eos")
    tensors = gguf_tensors(cfg, model.state_dict(), arch)
    types, fallbacks = _plan(tensors, quant, cfg.n_layer)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(name)
        w.add_string("kiln.version", __version__)
        w.add_file_type(int(getattr(gguf.LlamaFileType, FILE_TYPES[quant])))
        if quant in ("q8_0", "q4_0", "q4_k_m"):
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_hparams(w, cfg, arch)
        chat = _add_tokenizer(w, tok, cfg.vocab_size, tok.special_tokens[eos_token])
        with _bar(sum(a.size for a in tensors.values()), progress) as bar:
            for tname, array in tensors.items():
                data, qtype = encode(gguf, array, types[tname])
                w.add_tensor(tname, data, raw_dtype=qtype)
                bar.update(array.size)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        umask = os.umask(0)  # mkstemp makes 0600 files; give the one a plain open() would
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return GGUFResult(
        out=out, arch=arch, quant=quant, tensors=len(tensors), vocab=cfg.vocab_size,
        bytes=out.stat().st_size, chat_template=chat, types=types, fallbacks=fallbacks,
    )  # fmt: skip


def describe_gguf(result: GGUFResult) -> str:
    """What was written, for the CLI: one line (two for q4_k_m: its types and fallbacks)."""
    chat = ", chat template" if result.chat_template else ""
    line = (
        f"kiln export: {result.out} ({result.arch}, {result.quant}, {result.tensors} tensors, "
        f"{result.bytes / 1e6:.1f} MB; tokenizer: {result.vocab:,} tokens, gpt2 BPE{chat})"
    )
    if result.quant == "q4_k_m":
        line += "\n" + describe_plan(result.types, result.fallbacks)
    return line
