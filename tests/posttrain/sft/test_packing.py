"""Packing conversations into rows: the loss mask as ignored targets, packed vs padded layouts,
document masking equal to each conversation alone, and the row loader's exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.data.loader import LoaderCursor
from kiln.errors import KilnError
from kiln.model import ModelConfig, Transformer
from kiln.posttrain.sft.packing import IGNORE, RowLoader, build_rows, pairs


def _examples(lengths: list[int], seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Conversations of these lengths: random ids, the second half of each masked in."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(5, 90, n).tolist()
        out.append((ids, [0] * (n // 2) + [1] * (n - n // 2)))
    return out


def test_pairs_ignore_the_targets_the_mask_leaves_out() -> None:
    x, y = pairs([1, 2, 3, 4, 5], [0, 0, 1, 1, 0])
    assert x == [1, 2, 3, 4]
    assert y == [IGNORE, 3, 4, IGNORE]  # target i is ids[i+1], counted where mask[i+1]
    with pytest.raises(KilnError, match="differ in length"):
        pairs([1, 2], [1])


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_rows_hold_every_conversation_once_with_its_targets(layout: str) -> None:
    examples = _examples([9, 5, 12, 3, 7, 30])  # 30 > seq_len + 1: cut
    rows = build_rows(examples, 16, layout, pad_id=0)  # type: ignore[arg-type]
    assert rows.conversations == 6 and rows.truncated == 1
    expected = sorted(
        tuple(pairs(ids[:17], mask[:17])[1]) for ids, mask in examples
    )  # the targets of each (cut) conversation
    found = []
    for r in range(rows.n_rows):
        segs = rows.segments[r] if rows.segments is not None else np.zeros(16, dtype=np.int64)
        for s in np.unique(segs[rows.real[r]]):
            cells = rows.real[r] & (segs == s)
            assert np.all(np.diff(np.flatnonzero(cells)) == 1)  # one contiguous run
            found.append(tuple(rows.targets[r][cells].tolist()))
    assert sorted(found) == expected
    assert np.all(rows.targets[~rows.real] == IGNORE) and np.all(rows.inputs[~rows.real] == 0)
    if layout == "padded":
        assert rows.n_rows == 6 and rows.segments is None
    else:  # 16 + 11 + 8 + 6 + 4 + 2 = 47 positions: best fit needs only 3 rows of 16
        assert rows.n_rows == 3 and rows.real_tokens == 47


def test_a_conversation_with_nothing_to_learn_makes_no_row() -> None:
    rows = build_rows([([1, 2, 3], [0, 0, 0]), ([1, 2, 3], [0, 1, 1])], 8)
    assert rows.conversations == 1
    with pytest.raises(KilnError, match="no conversation with an assistant reply"):
        build_rows([([1, 2, 3], [0, 0, 0])], 8)


@pytest.mark.kernels
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_document_masking_equals_each_conversation_alone(arch: str) -> None:
    """Packed logits and loss are those of each conversation run on its own."""
    gpt2 = {"pos_emb": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True}
    kw = {} if arch == "llama" else gpt2  # the tiny preset is Llama-style
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny", vocab_size=96, block_size=32, **kw)).eval()
    examples = _examples([9, 5, 12, 3, 7, 14], seed=1)
    rows = build_rows(examples, 24, "packed")
    assert rows.segments is not None and rows.n_rows < len(examples)  # really packed
    x, y, seg = (torch.from_numpy(a) for a in (rows.inputs, rows.targets, rows.segments))
    with torch.no_grad():
        packed = model(x, segments=seg)  # (N, T, V)
        unpacked_causal = model(x)
        loss = model(x, y, seg)
    alone_total, n_targets, leaked = 0.0, 0, 0.0
    for r in range(rows.n_rows):
        for s in np.unique(rows.segments[r][rows.real[r]]):
            cells = torch.from_numpy(rows.real[r] & (rows.segments[r] == s))
            xi, yi = x[r][cells][None], y[r][cells][None]
            with torch.no_grad():
                alone = model(xi)
                torch.testing.assert_close(packed[r][cells][None], alone, atol=1e-5, rtol=1e-5)
                leaked = max(leaked, (unpacked_causal[r][cells][None] - alone).abs().max().item())
                n = int((yi >= 0).sum())
                alone_total += float(model(xi, yi)) * n
                n_targets += n
    assert leaked > 1e-3  # without the segments, later conversations would see earlier ones
    assert loss.item() == pytest.approx(alone_total / n_targets, rel=1e-5)


def test_row_loader_resumes_from_its_cursor_and_splits_ranks() -> None:
    rows = build_rows(_examples(list(range(3, 40))), 16)
    loader = RowLoader(rows, 4, seed=3)
    seen = [loader.next_batch() for _ in range(rows.n_rows)]  # several epochs
    again = RowLoader(rows, 4, seed=3, cursor=seen[4].cursor)
    for b in seen[5:]:
        nxt = again.next_batch()
        assert np.array_equal(nxt.inputs, b.inputs) and np.array_equal(nxt.segments, b.segments)
        assert nxt.cursor == b.cursor
    halves = [RowLoader(rows, 4, seed=3, rank=r, world_size=2).next_batch() for r in (0, 1)]
    assert np.array_equal(np.concatenate([h.inputs for h in halves]), seen[0].inputs)
    x, y, seg = seen[0].to_torch()
    assert x.shape == y.shape == seg.shape == (4, 16) and x.dtype == torch.int64
    with pytest.raises(KilnError, match="beyond the"):
        RowLoader(rows, 4, cursor=LoaderCursor(0, rows.n_rows))
