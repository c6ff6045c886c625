"""llama.cpp through llama-cpp-python's low-level API: greedy decoding of many sequences at once
and logits of a token sequence, for bench/serve.py and bench/gguf_parity.py.

llama-cpp-python's own server takes one request at a time (a lock around the model), and the
library does not build llama.cpp's `llama-server`; so the concurrent runs here do what that
server's parallel slots do: one `llama_decode` per step holding one token of every live
sequence, each sequence in its own KV stream (kv_unified off, as llama.cpp advises when prompts
share no prefix). Prompts are prefilled together in batches of up to `n_batch` tokens.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

_BACKEND_READY = False
GGML_TYPE_F32 = 0


def available() -> bool:
    """Whether llama-cpp-python is installed."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCpp:
    """One GGUF model and one context of `n_seq` streams of `seq_len` tokens each."""

    def __init__(
        self, path: str | Path, threads: int, n_seq: int = 1, seq_len: int = 512,
        n_batch: int = 512, kv_f32: bool = False,
    ) -> None:  # fmt: skip
        import llama_cpp as L

        global _BACKEND_READY
        if not _BACKEND_READY:
            L.llama_log_set(_QUIET, ctypes.c_void_p(0))
            L.llama_backend_init()
            _BACKEND_READY = True
        self.L = L
        self.model = L.llama_model_load_from_file(
            str(path).encode(), L.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError(f"{path}: llama.cpp could not load it")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_seq * seq_len
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = False
        cp.no_perf = True
        if kv_f32:  # the default f16 cache rounds K and V; f32 keeps kiln's numbers for parity
            cp.type_k = cp.type_v = GGML_TYPE_F32
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"{path}: llama.cpp could not create a context")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_batch, self.n_seq = n_batch, n_seq
        self.batch = L.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        """Free the batch, the context and the model (once; also when garbage-collected)."""
        if self.ctx is None:
            return
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)
        self.ctx = None

    def __del__(self) -> None:
        """The C memory goes with the object (bench/serve.py builds many, one per table)."""
        if getattr(self, "ctx", None) is not None:
            self.close()

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, wants) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, wants
            b.seq_id[i][0] = seq
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _row(self, i: int) -> np.ndarray:
        """The logits of entry i of the last decode."""
        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def clear(self) -> None:
        """Empty every KV stream."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def logits(self, ids: list[int]) -> np.ndarray:
        """(len(ids), vocab) float32 logits of one sequence, prefilled in n_batch chunks."""
        self.clear()
        out = np.empty((len(ids), self.n_vocab), dtype=np.float32)
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            self._decode([(t, start + j, 0, True) for j, t in enumerate(chunk)])
            for j in range(len(chunk)):
                out[start + j] = self._row(j)
        return out

    def greedy(self, prompts: list[list[int]], outs: list[int]) -> list[list[int]]:
        """Greedy continuations, all sequences decoded together (one token each per step)."""
        if len(prompts) > self.n_seq:
            raise ValueError(f"{len(prompts)} prompts for a context of {self.n_seq} sequences")
        self.clear()
        last: dict[int, int] = {}  # sequence -> the token it decodes next
        entries = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in
                   enumerate(p)]  # fmt: skip
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start : start + self.n_batch]
            self._decode(chunk)
            for j, (_, _, seq, wants) in enumerate(chunk):
                if wants:
                    last[seq] = int(np.argmax(self._row(j)))
        generated: list[list[int]] = [[last[s]] for s in range(len(prompts))]
        while True:
            live = [s for s in range(len(prompts)) if len(generated[s]) < outs[s]]
            if not live:
                return generated
            self._decode([(generated[s][-1], len(prompts[s]) + len(generated[s]) - 1, s, True)
                          for s in live])  # fmt: skip
            for j, s in enumerate(live):
                generated[s].append(int(np.argmax(self._row(j))))


def _quiet(level: int, text: bytes, user_data: Any) -> None:
    """llama.cpp's log callback: say nothing (it prints every tensor at load otherwise)."""


def _make_quiet() -> Any:
    import llama_cpp as L

    return L.llama_log_callback(_quiet)


try:
    _QUIET = _make_quiet()
except ImportError:
    _QUIET = None
