"""The ladder's lower rungs: fit or train each baseline on a shard dataset, score it by the
speedrun's bits per byte.

Count models (`bigram`: add-k, `kn`: interpolated Kneser–Ney) are fitted on the train split and
their one free setting (k; order and discount) is picked on the dataset's val split. Neural ones
(`bigram-nn`: the learned bigram, `mlp`: Bengio's n-gram MLP) train with AdamW for a budget of
CPU seconds (`time.process_time`, so runs sharing a loaded machine get equal work). Every rung is
then scored on a text file by `kiln.eval.lm`'s stream: the same stream, windows and byte count
as `stream_bits_per_byte` (the neural rungs go through it; the count rungs score the identical
targets with the identical contexts in `window_contexts`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.eval.baselines.counts import AddKBigram, KneserNey, window_contexts
from kiln.eval.scoring import rolling_windows

COUNT_RUNGS = ("bigram", "kn")
NEURAL_RUNGS = ("bigram-nn", "mlp")
RUNGS = COUNT_RUNGS + NEURAL_RUNGS
ADD_K = (1.0, 0.3, 0.1, 0.03, 0.01, 0.003)
KN_ORDERS = (3, 4, 5)
KN_DISCOUNTS = (0.6, 0.75, 0.9)
SCORE_ROWS = 200_000  # count models score this many targets at a time


@dataclass
class RungResult:
    """One rung: what it is, how long it took, and its bits per byte on the scored file."""

    rung: str
    params: int  # count models: stored n-gram entries
    settings: dict[str, Any]
    train_s: float  # CPU seconds fitting or training
    valid_bpb: float
    n_tokens: int
    n_bytes: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the JSON report."""
        return asdict(self)


def count_nats(model: Any, ids: np.ndarray, block_size: int) -> tuple[float, int]:
    """(summed nats, targets) of a count model over `ids` in disjoint windows of block_size."""
    windows = rolling_windows(len(ids), block_size, block_size)
    contexts, targets = window_contexts(ids, model.order - 1, windows)
    nats = 0.0
    for s in range(0, len(targets), SCORE_ROWS):
        nats -= float(
            model.logprob(contexts[s : s + SCORE_ROWS], targets[s : s + SCORE_ROWS]).sum()
        )
    return nats, len(targets)


def fit_count_model(
    rung: str, train: np.ndarray, val: np.ndarray, vocab: int, block_size: int
) -> tuple[Any, dict[str, Any]]:
    """The count model of `rung` fitted on `train`, its setting chosen by nats on `val`."""
    if rung == "bigram":
        model = AddKBigram(vocab).fit(train)
        scores = {}
        for k in ADD_K:
            model.k = k
            scores[k] = count_nats(model, val, block_size)[0]
        model.k = min(scores, key=scores.__getitem__)
        return model, {"k": model.k}
    best: tuple[float, Any, dict[str, Any]] | None = None
    for order in KN_ORDERS:
        if vocab**order >= 2**63:
            continue
        model = KneserNey(vocab, order).fit(train)
        for d in KN_DISCOUNTS:
            model.discount = d
            nats = count_nats(model, val, block_size)[0]
            if best is None or nats < best[0]:
                best = (nats, model, {"order": order, "discount": d})
    if best is None:
        raise KilnError(f"no Kneser–Ney order in {KN_ORDERS} fits an int64 key at vocab {vocab}")
    best[1].discount = best[2]["discount"]
    return best[1], best[2]


def count_entries(model: Any) -> int:
    """Stored numbers of a count model (its "parameters")."""
    if isinstance(model, AddKBigram):
        return len(model.pairs.keys) + len(model.firsts.keys)
    return sum(len(lv.num.keys) + len(lv.den.keys) for lv in model.levels.values()) + model.vocab


@dataclass(frozen=True)
class NeuralSettings:
    """How a neural rung trains: AdamW at lr, constant then linearly down over the last 20%."""

    budget_s: float = 60.0
    batch: int = 32
    seq_len: int = 128
    lr: float | None = None  # None: the rung's own (bigram-nn 0.05, mlp 3e-3)
    seed: int = 0
    max_steps: int | None = None  # stop early (tests)


def train_neural(
    model: Any,
    train: np.ndarray,
    settings: NeuralSettings,
    lr: float,
    clock: Callable[[], float] = time.process_time,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train on random windows of `train` for the CPU-second budget; steps, tokens, final loss."""
    import torch

    torch.manual_seed(settings.seed)
    rng = np.random.default_rng(settings.seed)
    T = min(settings.seq_len, len(train) - 1)
    if T < 1:
        raise KilnError(f"the train split has {len(train)} tokens, need 2+")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = torch.as_tensor(np.asarray(train, dtype=np.int64))
    model.train()
    start, steps, loss_value, last_print = clock(), 0, math.nan, 0.0
    while True:
        spent = clock() - start
        if spent >= settings.budget_s or steps == settings.max_steps:
            break
        left = 1 - spent / settings.budget_s
        for group in opt.param_groups:  # constant, then down to 10% over the last fifth
            group["lr"] = lr * (1.0 if left > 0.2 else 0.1 + 0.9 * left / 0.2)
        offsets = torch.as_tensor(rng.integers(0, len(train) - T, settings.batch))
        rows = data[offsets[:, None] + torch.arange(T + 1)]  # (B, T+1)
        loss = model(rows[:, :-1], rows[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps, loss_value = steps + 1, float(loss.detach())
        if progress is not None and spent - last_print >= 10:
            last_print = spent
            rate = steps * settings.batch * T / max(spent, 1e-9)
            progress(
                f"  step {steps}, loss {loss_value:.3f}, {rate:,.0f} tok/s, "
                f"{settings.budget_s - spent:.0f} s left"
            )
    model.eval()
    return {"steps": steps, "tokens": steps * settings.batch * T, "final_loss": loss_value,
            "cpu_s": round(clock() - start, 2)}  # fmt: skip


def run_rung(
    rung: str,
    dataset: str | Path,
    valid: str | Path,
    block_size: int = 256,
    neural: NeuralSettings = NeuralSettings(),
    progress: Callable[[str], None] | None = None,
) -> RungResult:
    """Fit or train one rung on `dataset`'s shards and score `valid` (the speedrun's bpb)."""
    from kiln.data.shard_reader import Dataset
    from kiln.tokenizer.formats import read_any

    if rung not in RUNGS:
        raise KilnError(f"unknown baseline {rung!r}; expected one of {', '.join(RUNGS)}")
    ds = Dataset.open(dataset)
    where = ds.manifest.tokenizer.locate(Path(dataset))
    if where is None:
        raise KilnError(f"{dataset}: the tokenizer its manifest names is not found")
    tok, eot = read_any(where), ds.eot_id
    vocab = ds.manifest.tokenizer.vocab_size
    train = np.asarray(ds.split("train").read(0, ds.split("train").n_tokens), dtype=np.int64)
    val_split = ds.split("val")
    val = np.asarray(val_split.read(0, val_split.n_tokens), dtype=np.int64)
    t0 = time.process_time()
    if rung in COUNT_RUNGS:
        if len(val) < 2:
            raise KilnError(f"{dataset}: the val split is empty; count models tune on it")
        model, settings = fit_count_model(rung, train, val, vocab, block_size)
        train_s = time.process_time() - t0
        return _score_counts(rung, model, settings, train_s, tok, valid, eot, block_size)
    return _train_and_score_neural(
        rung, train, vocab, tok, valid, eot, block_size, neural, progress
    )


def _score_counts(
    rung: str, model: Any, settings: dict[str, Any], train_s: float, tok: Any, valid: Any,
    eot: int, block_size: int,
) -> RungResult:  # fmt: skip
    from kiln.eval.lm import encode_stream

    stream = encode_stream(tok, valid, eot)
    nats, n = count_nats(model, np.asarray(stream.ids, dtype=np.int64), block_size)
    return RungResult(
        rung, count_entries(model), settings, round(train_s, 2),
        round(nats / (math.log(2) * stream.n_bytes), 4), n, stream.n_bytes,
    )  # fmt: skip


def _train_and_score_neural(
    rung: str, train: np.ndarray, vocab: int, tok: Any, valid: Any, eot: int, block_size: int,
    neural: NeuralSettings, progress: Callable[[str], None] | None,
) -> RungResult:  # fmt: skip
    import torch

    from kiln.eval.lm import stream_bits_per_byte
    from kiln.eval.scoring import Scorer
    from kiln.model.baselines import BaselineConfig, build_baseline

    kind = "bigram" if rung == "bigram-nn" else "mlp"
    cfg = BaselineConfig(kind, vocab, block_size)
    model = build_baseline(cfg)
    lr = neural.lr or (0.05 if kind == "bigram" else 3e-3)
    stats = train_neural(model, train, neural, lr, progress=progress)
    with torch.no_grad():
        scored = stream_bits_per_byte(Scorer(model, progress=False), tok, valid, eot)
    settings = {"lr": lr, "batch": neural.batch, "seq_len": neural.seq_len}
    if kind == "mlp":
        settings |= {"context": cfg.context, "n_embd": cfg.n_embd, "hidden": cfg.hidden}
    return RungResult(
        rung, sum(p.numel() for p in model.parameters()), settings, stats.pop("cpu_s"),
        round(scored.bits_per_byte or 0.0, 4), scored.n_tokens, scored.n_bytes, stats,
    )  # fmt: skip
