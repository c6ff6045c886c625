"""Token shards: round trip, dtype, val split, atomic output, and clear errors on corruption."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from kiln.data import Dataset
from kiln.data import tokenize_shards as tokenize_module
from kiln.data.documents import iter_documents
from kiln.data.shard_format import HEADER_BYTES
from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards
from kiln.errors import KilnError
from kiln.tokenizer import Tokenizer
from tests.data.conftest import DOCS_A, DOCS_B, EOT, SHARED_DATA, write_inputs
from tests.fixtures import require_shared


def _decoded(ds: Dataset, tok: Tokenizer, split: str) -> list[tuple[str, str]]:
    """(text, source path) of every document of a split, checking each ends with end-of-text."""
    out = []
    sp = ds.split(split)
    for i in range(sp.n_documents):
        tokens = sp.document(i)
        assert int(tokens[-1]) == ds.eot_id
        assert ds.eot_id not in tokens[:-1].tolist()
        out.append((tok.decode(tokens[:-1].tolist()), sp.document_source(i)))
    return out


def _is_subsequence(part: list, whole: list) -> bool:
    it = iter(whole)
    return all(any(x == y for y in it) for x in part)


@pytest.mark.parametrize("shard_tokens", [1, 40, 100_000_000])
def test_round_trip_recovers_every_document_and_its_source(
    build_dataset, tiny_tokenizer_file, tmp_path, shard_tokens
) -> None:
    inputs = write_inputs(tmp_path / "inputs")
    ds = Dataset.open(build_dataset(inputs=inputs, shard_tokens=shard_tokens, val_docs=3))
    tok = Tokenizer.load(tiny_tokenizer_file)
    expected = [(d, str(inputs[0].resolve())) for d in DOCS_A]
    expected += [(d, str(inputs[1].resolve())) for d in DOCS_B]
    train, val = _decoded(ds, tok, "train"), _decoded(ds, tok, "val")
    assert len(val) == 3 and len(train) == len(expected) - 3
    assert sorted(train + val) == sorted(expected)
    # Within a split, documents keep their input order.
    assert _is_subsequence(train, expected) and _is_subsequence(val, expected)
    if shard_tokens == 1:  # a document longer than a shard gets a shard of its own
        assert len(ds.split("train").shards) == len(train)
    # The split reads as one stream: concatenated documents equal the shards' tokens.
    sp = ds.split("train")
    stream = np.concatenate([sp.document(i) for i in range(sp.n_documents)])
    assert np.array_equal(sp.read(0, sp.n_tokens), stream)
    assert np.array_equal(sp.read(3, 50), stream[3:53])


def test_manifest_reports_sources_splits_and_config(build_dataset, tiny_tokenizer_file) -> None:
    root = build_dataset(val_docs=2)
    m = json.loads((root / "manifest.json").read_text())
    assert m["format"] == "kiln-shards" and m["version"] == 1
    assert m["tokenizer"]["sha256"] == Dataset.open(root).manifest.tokenizer.sha256
    assert m["tokenizer"]["eot_id"] == Tokenizer.load(tiny_tokenizer_file).special_tokens[EOT]
    assert m["dtype"] == "uint16" and m["config"]["val_docs"] == 2
    docs = [sum(s["documents"].values()) for s in m["sources"]]
    assert docs == [len(DOCS_A), len(DOCS_B)]
    for split in ("train", "val"):
        assert sum(s["tokens"][split] for s in m["sources"]) == m["splits"][split]["tokens"]
    assert sorted(os.listdir(root)) == [
        "manifest.json",
        *sorted(
            f"{s['name']}{ext}"
            for sp in m["splits"].values()
            for s in sp["shards"]
            for ext in (".bin", ".idx")
        ),
    ]


def test_dtype_is_uint16_for_small_vocab_and_uint32_beyond(
    build_dataset, tiny_tokenizer_file, wide_tokenizer_file
) -> None:
    narrow = Dataset.open(build_dataset("narrow"))
    wide = Dataset.open(build_dataset("wide", tokenizer=str(wide_tokenizer_file)))
    assert narrow.manifest.dtype == "uint16" and wide.manifest.dtype == "uint32"
    assert narrow.split("train").shards[0].tokens.dtype == np.dtype("<u2")
    assert wide.split("train").shards[0].tokens.dtype == np.dtype("<u4")
    assert wide.eot_id == 70_000 and int(wide.split("train").document(0)[-1]) == 70_000
    narrow_texts = _decoded(narrow, Tokenizer.load(tiny_tokenizer_file), "train")
    assert _decoded(wide, Tokenizer.load(wide_tokenizer_file), "train") == narrow_texts
    # Same documents, same ids below the special token: only the width differs.
    n = narrow.split("train").document(0)
    w = wide.split("train").document(0)
    assert np.array_equal(n[:-1].astype(np.int64), w[:-1].astype(np.int64))


def _val_texts(root: Path) -> list[str]:
    ds = Dataset.open(root)
    tok = Tokenizer.load(ds.manifest.tokenizer.path)
    return [t for t, _ in _decoded(ds, tok, "val")]


def test_val_split_is_by_document_and_deterministic_from_seed(build_dataset) -> None:
    first = _val_texts(build_dataset("s0a", val_docs=3, seed=0))
    again = _val_texts(build_dataset("s0b", val_docs=3, seed=0))
    assert first == again and len(first) == 3
    others = {tuple(_val_texts(build_dataset(f"s{s}", val_docs=3, seed=s))) for s in range(1, 6)}
    assert len(others | {tuple(first)}) > 1  # the seed chooses which documents
    assert len(_val_texts(build_dataset("f", val_docs=None, val_fraction=0.25))) == 2
    empty = Dataset.open(build_dataset("none", val_docs=0)).split("val")
    assert empty.n_documents == 0 and empty.shards == [] and len(empty.read(0, 0)) == 0


def test_val_docs_that_leave_no_training_data_is_an_error(build_dataset) -> None:
    with pytest.raises(KilnError, match="leaves no training documents"):
        build_dataset(val_docs=len(DOCS_A) + len(DOCS_B))


def test_parallel_workers_write_the_same_bytes_as_one_process(build_dataset) -> None:
    serial = build_dataset("serial", shard_tokens=60)
    parallel = build_dataset(
        "parallel", shard_tokens=60, workers=2, parallel_min_bytes=0, batch_chars=50
    )
    names = sorted(p.name for p in serial.iterdir() if p.suffix in (".bin", ".idx"))
    assert names == sorted(p.name for p in parallel.iterdir() if p.suffix in (".bin", ".idx"))
    for name in names:
        assert (serial / name).read_bytes() == (parallel / name).read_bytes(), name


def test_tinystories_valid_round_trips(tmp_path) -> None:
    source = require_shared(SHARED_DATA / "tinystories" / "valid.txt.gz")
    from kiln.tokenizer import train_bpe

    tok = train_bpe(source, 1024, special_tokens=[EOT])
    tok_path = tmp_path / "tok.json"
    tok.save(tok_path)
    config = TokenizeConfig(
        tokenizer=str(tok_path),
        inputs=(str(source),),
        out=str(tmp_path / "ts"),
        val_fraction=0.05,
        shard_tokens=50_000,
        progress=False,
    )
    tokenize_to_shards(config)
    ds = Dataset.open(tmp_path / "ts", tokenizer=tok_path, verify=True)
    docs = list(iter_documents(str(source), EOT))
    train, val = ds.split("train"), ds.split("val")
    assert train.n_documents + val.n_documents == len(docs) > 900
    assert val.n_documents == round(0.05 * len(docs)) and len(train.shards) > 3
    decoded = _decoded(ds, tok, "train") + _decoded(ds, tok, "val")
    assert sorted(t for t, _ in decoded) == sorted(docs)
    assert {s for _, s in decoded} == {str(source)}


# ------------------------------------------------------------------------------ output safety
def test_refuses_to_overwrite_without_force_and_replaces_with_it(build_dataset) -> None:
    root = build_dataset(seed=0)
    before = (root / "manifest.json").read_bytes()
    with pytest.raises(KilnError, match="already exists; pass --force"):
        build_dataset(seed=1)
    assert (root / "manifest.json").read_bytes() == before
    build_dataset(seed=1, force=True)
    assert json.loads((root / "manifest.json").read_text())["config"]["seed"] == 1
    assert [p.name for p in root.parent.iterdir() if p.name.startswith(".")] == []


def test_force_does_not_delete_a_directory_that_is_not_a_dataset(build_dataset, tmp_path) -> None:
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(KilnError, match="not a kiln dataset"):
        build_dataset("precious", force=True)
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"


def test_a_failure_midway_leaves_the_old_dataset_and_no_temp_files(
    build_dataset, monkeypatch
) -> None:
    root = build_dataset()
    before = {p.name: p.read_bytes() for p in root.iterdir()}

    def boom(*args, **kwargs):
        raise KilnError("encoder exploded")

    monkeypatch.setattr(tokenize_module, "encode_documents", boom)
    with pytest.raises(KilnError, match="encoder exploded"):
        build_dataset(force=True)
    assert {p.name: p.read_bytes() for p in root.iterdir()} == before
    assert [p.name for p in root.parent.iterdir() if p.name.startswith(".")] == []


def test_missing_end_of_text_token_is_a_clear_error(build_dataset, tmp_path) -> None:
    with pytest.raises(KilnError, match="no special token '<eos>'"):
        build_dataset(eot_token="<eos>")
    assert not (tmp_path / "ds").exists()


# --------------------------------------------------------------------------- corruption checks
def _first_shard(root: Path, split: str = "train") -> tuple[Path, Path]:
    return root / f"{split}_000000.bin", root / f"{split}_000000.idx"


def test_truncated_shard_is_named_in_the_error(build_dataset) -> None:
    root = build_dataset()
    bin_path, _ = _first_shard(root)
    os.truncate(bin_path, bin_path.stat().st_size - 2)
    with pytest.raises(KilnError, match=r"train_000000\.bin: file is .* truncated"):
        Dataset.open(root)


def test_header_problems_are_clear_errors(build_dataset) -> None:
    root = build_dataset()
    bin_path, idx_path = _first_shard(root)
    data = bytearray(bin_path.read_bytes())
    bad_magic = b"NOTKILN\0" + data[8:]
    bin_path.write_bytes(bad_magic)
    with pytest.raises(KilnError, match=r"train_000000\.bin: not a kiln token shard"):
        Dataset.open(root)
    bin_path.write_bytes(data[:8] + struct.pack("<I", 9) + data[12:])
    with pytest.raises(KilnError, match="version 9"):
        Dataset.open(root)
    # A consistent but shorter shard: header and size agree, the manifest does not.
    n = struct.unpack_from("<Q", data, 16)[0]
    short = data[:16] + struct.pack("<Q", n - 1) + data[24 : HEADER_BYTES + 2 * (n - 1)]
    bin_path.write_bytes(short)
    with pytest.raises(KilnError, match=f"header says {n - 1} tokens, the manifest {n}"):
        Dataset.open(root)
    bin_path.write_bytes(data)
    os.truncate(idx_path, idx_path.stat().st_size - 4)
    with pytest.raises(KilnError, match=r"train_000000\.idx: .* truncated"):
        Dataset.open(root)
    idx_path.unlink()
    with pytest.raises(KilnError, match=r"train_000000\.idx: missing"):
        Dataset.open(root)


def test_manifest_problems_are_clear_errors(build_dataset) -> None:
    root = build_dataset()
    path = root / "manifest.json"
    good = json.loads(path.read_text())
    for change, message in [
        ({"dtype": "uint32"}, "header says uint16 tokens, the manifest uint32"),
        ({"format": "other"}, "format is 'other', expected 'kiln-shards'"),
        ({"version": 2}, "version 2"),
        ({"splits": {"train": {"shards": [{"name": "x"}]}}}, "malformed manifest"),
    ]:
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(KilnError, match=message):
            Dataset.open(root)
    path.write_text("{not json")
    with pytest.raises(KilnError, match=r"manifest\.json: not valid JSON"):
        Dataset.open(root)
    path.unlink()
    with pytest.raises(KilnError, match="not a kiln token-shard dataset"):
        Dataset.open(root)


def test_tokenizer_mismatch_and_changed_bytes_are_detected(
    build_dataset, tiny_tokenizer_file, wide_tokenizer_file
) -> None:
    root = build_dataset()
    Dataset.open(root, tokenizer=tiny_tokenizer_file)
    with pytest.raises(KilnError, match=r"tok70k\.json: sha256 .* differs from the tokenizer"):
        Dataset.open(root, tokenizer=wide_tokenizer_file)
    bin_path, _ = _first_shard(root)
    data = bytearray(bin_path.read_bytes())
    data[HEADER_BYTES] ^= 1
    bin_path.write_bytes(data)
    Dataset.open(root, verify=False)  # headers, sizes and the id range are still consistent
    with pytest.raises(KilnError, match=r"train_000000\.bin: sha256 differs"):
        Dataset.open(root)  # verified by default


def test_zstd_and_plain_text_inputs_give_the_same_tokens(build_dataset, tmp_path) -> None:
    import zstandard

    text = "".join(f"{d}\n{EOT}\n" for d in DOCS_A).encode()
    plain, packed = tmp_path / "plain.txt", tmp_path / "packed.txt.zst"
    plain.write_bytes(text)
    packed.write_bytes(zstandard.ZstdCompressor().compress(text))
    a = Dataset.open(build_dataset("plain", inputs=[plain], val_docs=0)).split("train")
    b = Dataset.open(build_dataset("packed", inputs=[packed], val_docs=0)).split("train")
    assert a.n_documents == len(DOCS_A)
    assert np.array_equal(a.read(0, a.n_tokens), b.read(0, b.n_tokens))
