"""Bad inputs to the data commands (and eval's task/text files) get one clear line naming the
file, exit code 2 and no traceback; corrupt shards are refused before they are trained on."""

from __future__ import annotations

import bz2
import gzip
import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zstandard

import kiln.cli
from kiln.data.manifest import MANIFEST_NAME
from kiln.data.shard_format import HEADER_BYTES
from kiln.data.shard_reader import Dataset
from kiln.errors import KilnError
from kiln.eval.lm import read_documents
from kiln.tokenizer.formats import read_any
from tests.data.conftest import EOT

# --------------------------------------------------------------------------- helpers


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Run `kiln ARGV` in-process; (exit code, stderr)."""
    code = kiln.cli.main(argv)
    return code, capsys.readouterr().err


def assert_one_clear_line(code: int, err: str, *names: str) -> str:
    """Exit code 2, a single `kiln: error:` line naming every one of `names`, no traceback."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kiln: error: "), err
    for name in names:
        assert name in lines[0], err
    return lines[0]


def _text(n_docs: int = 400) -> bytes:
    """Documents of varied words (compresses to well over one read block), EOT-separated."""
    rng = random.Random(0)
    words = [f"w{rng.randrange(10**6)}" for _ in range(3000)]
    docs = [" ".join(rng.choices(words, k=80)) for _ in range(n_docs)]
    return "".join(f"{d}\n{EOT}\n" for d in docs).encode()


def _jsonl(n_docs: int = 400) -> bytes:
    docs = _text(n_docs).decode().split(f"\n{EOT}\n")[:-1]
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


_COMPRESS: dict[str, Callable[[bytes], bytes]] = {
    "gz": gzip.compress,
    "bz2": bz2.compress,
    "zst": zstandard.ZstdCompressor().compress,
}
DAMAGE = [
    ("gz", "not compressed"),
    ("gz", "truncated"),
    ("bz2", "not compressed"),
    ("bz2", "truncated"),
    ("zst", "not compressed"),
    ("zst", "truncated"),
]


def damaged(path: Path, payload: bytes, kind: str) -> Path:
    """`path` holding `payload` compressed by its suffix, then cut in half or replaced."""
    packed = _COMPRESS[path.name.rsplit(".", 1)[1]](payload)
    if kind == "truncated":
        path.write_bytes(packed[: len(packed) // 2])
    else:
        path.write_bytes(b"this is plain text, not compressed at all\n" * 50)
    return path


# ----------------------------------------------------------- item 7: damaged compressed inputs


@pytest.mark.parametrize(("suffix", "kind"), DAMAGE)
@pytest.mark.parametrize("inner", ["txt", "jsonl"])
def test_tokenize_damaged_compressed_input_is_one_line(
    capsys, tmp_path, tiny_tokenizer_file, suffix, kind, inner
) -> None:
    payload = _text() if inner == "txt" else _jsonl()
    bad = damaged(tmp_path / f"in.{inner}.{suffix}", payload, kind)
    argv = ["data", "tokenize", "--tokenizer", str(tiny_tokenizer_file), str(bad)]
    code, err = _main([*argv, "--out", str(tmp_path / "ds"), "--quiet", "--workers", "1"], capsys)
    assert_one_clear_line(code, err, str(bad), "corrupt or truncated compressed file")
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize(("suffix", "kind"), DAMAGE)
def test_data_run_damaged_compressed_input_is_one_line(
    capsys, tmp_path, tiny_tokenizer_file, suffix, kind
) -> None:
    bad = damaged(tmp_path / f"in.txt.{suffix}", _text(), kind)
    config = tmp_path / "p.toml"
    config.write_text(
        f'[[sources]]\nname = "s"\npaths = ["{bad}"]\n'
        f'[tokenize]\ntokenizer = "{tiny_tokenizer_file}"\n',
        encoding="utf-8",
    )
    argv = ["data", "run", str(config), "--out", str(tmp_path / "out"), "--quiet"]
    code, err = _main([*argv, "--workers", "1"], capsys)
    assert_one_clear_line(code, err, str(bad), "corrupt or truncated compressed file")
    # Nothing was done that a re-run could use: no out.partial/ is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([bad.name, config.name])


@pytest.mark.parametrize(("suffix", "kind"), DAMAGE)
def test_eval_bpb_text_damaged_is_one_clear_error(tmp_path, suffix, kind) -> None:
    bad = damaged(tmp_path / f"text.txt.{suffix}", _text(), kind)
    with pytest.raises(KilnError, match=r"text\.txt\.\w+: corrupt or truncated compressed file"):
        read_documents(bad)


@pytest.mark.parametrize("kind", ["not compressed", "truncated"])
def test_eval_task_file_damaged_is_one_line(capsys, tmp_path, kind) -> None:
    """hellaswag's task file is .bz2; the task is read before the model is even loaded."""
    lines = "".join(
        f"ctx number {i} of a story\nending one\nending two\nending three\nending four\n{i % 4}\n"
        for i in range(3000)
    ).encode()
    bad = damaged(tmp_path / "hellaswag_val.txt.bz2", lines, kind)
    argv = ["eval", str(tmp_path / "no-model"), "--tasks", "hellaswag", "--data-dir", str(tmp_path)]
    code, err = _main(argv, capsys)
    assert_one_clear_line(code, err, str(bad), "corrupt or truncated compressed file")


def test_intact_compressed_inputs_still_read_whole(tmp_path) -> None:
    payload = _text()
    for suffix, compress in _COMPRESS.items():
        path = tmp_path / f"ok.txt.{suffix}"
        path.write_bytes(compress(payload[:1000]) + compress(payload[1000:]))  # two members
        assert read_documents(path) == [payload.decode()]


# ------------------------------------------------------------- item 8: corrupt shard contents


def first_bin(root: Path) -> Path:
    """The first training shard of a dataset folder."""
    return root / "train_000000.bin"


def poke_token(path: Path, position: int, value: int) -> None:
    """Overwrite one uint16 token of a shard in place (a corrupted shard for the checks)."""
    data = bytearray(path.read_bytes())
    at = HEADER_BYTES + 2 * position  # the tiny tokenizer's shards are uint16
    data[at : at + 2] = np.array([value], dtype=np.uint16).tobytes()
    path.write_bytes(data)


def test_writer_records_each_shards_largest_id(build_dataset) -> None:
    root = build_dataset(shard_tokens=40)
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    ds = Dataset.open(root)
    for name, split in manifest["splits"].items():
        for entry, shard in zip(split["shards"], ds.split(name).shards, strict=True):
            assert entry["max_id"] == int(np.asarray(shard.tokens).max())


@pytest.mark.parametrize("value", [65_535, 5], ids=["out-of-range", "in-range"])
def test_corrupted_shard_bytes_are_refused_with_the_shards_name(
    capsys, build_dataset, value
) -> None:
    root = build_dataset()
    poke_token(first_bin(root), 3, value)
    with pytest.raises(KilnError, match=r"train_000000\.bin: sha256 differs"):
        Dataset.open(root)  # what kiln train and kiln eval --val do
    code, err = _main(["data", "inspect", str(root)], capsys)
    assert_one_clear_line(code, err, "train_000000.bin")


def test_out_of_range_ids_are_refused_without_verification_on_old_manifests(
    build_dataset, monkeypatch
) -> None:
    """A manifest without max_id (older kiln) is scanned; sha256 checks switched off."""
    root = build_dataset()
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    for split in manifest["splits"].values():
        for entry in split["shards"]:
            del entry["max_id"]
    (root / MANIFEST_NAME).write_text(json.dumps(manifest))
    Dataset.open(root, verify=False)  # intact: opens
    poke_token(first_bin(root), 3, 65_535)
    monkeypatch.setenv("KILN_VERIFY_SHARDS", "0")
    with pytest.raises(KilnError, match=r"train_000000\.bin: holds token id 65535, outside"):
        Dataset.open(root)


def test_recorded_max_id_beyond_the_vocabulary_is_refused(build_dataset) -> None:
    root = build_dataset()
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    manifest["tokenizer"]["vocab_size"] = 10  # as if encoded with another tokenizer
    (root / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(KilnError, match=r"train_000000\.bin: holds token id \d+, outside .* 10;"):
        Dataset.open(root, verify=False)


def test_verification_can_be_switched_off(capsys, build_dataset, monkeypatch) -> None:
    root = build_dataset()
    poke_token(first_bin(root), 3, 5)
    assert Dataset.open(root, verify=False)
    code, _ = _main(["data", "inspect", str(root), "--no-verify"], capsys)
    assert code == 0
    monkeypatch.setenv("KILN_VERIFY_SHARDS", "0")
    assert Dataset.open(root)


# ------------------------------------------------------- item 9: special-token id far too big


def test_huge_special_token_id_is_refused(capsys, tmp_path, tiny_tokenizer_file) -> None:
    doc = json.loads(tiny_tokenizer_file.read_text())
    doc["special_tokens"] = {EOT: 50_000_000}
    bad = tmp_path / "huge.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(KilnError, match=r"huge\.json: special token .* id 50,000,000, far"):
        read_any(bad)
    inputs = tmp_path / "a.txt"
    inputs.write_text(f"hello\n{EOT}\n")
    argv = ["data", "tokenize", "--tokenizer", str(bad), str(inputs), "--out", str(tmp_path / "d")]
    code, err = _main([*argv, "--quiet"], capsys)
    assert_one_clear_line(code, err, str(bad), "50,000,000")


def test_special_ids_a_little_past_the_vocabulary_still_load(wide_tokenizer_file) -> None:
    assert read_any(wide_tokenizer_file).special_tokens[EOT] == 70_000


# ------------------------------------------------ item 11: a source path matching no file


def test_a_typo_in_a_source_path_leaves_nothing_and_does_not_pin_the_config(
    capsys, tmp_path, tiny_tokenizer_file
) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_bytes(_text(30))
    config = tmp_path / "p.toml"

    def write_config(pattern: str) -> None:
        config.write_text(
            f'[[sources]]\nname = "s"\npaths = ["{tmp_path / pattern}"]\n'
            f'[tokenize]\ntokenizer = "{tiny_tokenizer_file}"\n',
            encoding="utf-8",
        )

    out = tmp_path / "out"
    argv = ["data", "run", str(config), "--out", str(out), "--quiet", "--workers", "1"]
    write_config("doc/*.txt")
    code, err = _main(argv, capsys)
    assert_one_clear_line(code, err, "matches no file")
    assert not out.with_name("out.partial").exists()
    write_config("docs/*.txt")
    code, err = _main(argv, capsys)
    assert code == 0, err
    assert Dataset.open(out).manifest.pipeline


def test_an_untouched_partial_of_another_config_is_replaced(tmp_path, tiny_tokenizer_file) -> None:
    from kiln.data.pipeline.config import load_pipeline_config
    from kiln.data.pipeline.runner import RunOptions, run_pipeline

    (tmp_path / "a.txt").write_bytes(_text(20))
    config = tmp_path / "p.toml"
    config.write_text(
        f'[[sources]]\nname = "s"\npaths = ["{tmp_path / "a.txt"}"]\n'
        f'[tokenize]\ntokenizer = "{tiny_tokenizer_file}"\n',
        encoding="utf-8",
    )
    partial = tmp_path / "out.partial" / "pipeline"
    partial.mkdir(parents=True)
    (partial / "run.json").write_text(json.dumps({"digest": "0123456789abcdef"}))
    run_pipeline(
        load_pipeline_config(config), RunOptions(out=str(tmp_path / "out"), progress=False)
    )
    assert (tmp_path / "out" / MANIFEST_NAME).is_file()


# ----------------------------------------------------------------- the bad-input table


def _row_missing_input(tmp: Path, tok: Path) -> tuple[list[str], list[str]]:
    missing = tmp / "nope.txt"
    argv = ["data", "tokenize", "--tokenizer", str(tok), str(missing), "--out", str(tmp / "d")]
    return argv, [str(missing)]


def _row_bad_jsonl(tmp: Path, tok: Path) -> tuple[list[str], list[str]]:
    bad = tmp / "b.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    argv = ["data", "tokenize", "--tokenizer", str(tok), str(bad), "--out", str(tmp / "d")]
    return argv, [f"{bad}:2", "invalid JSON"]


def _row_not_a_dataset(tmp: Path, tok: Path) -> tuple[list[str], list[str]]:
    (tmp / "empty").mkdir()
    return ["data", "inspect", str(tmp / "empty")], ["manifest.json"]


def _row_truncated_shard(tmp: Path, tok: Path) -> tuple[list[str], list[str]]:
    src = tmp / "a.txt"
    src.write_bytes(_text(20))
    out = tmp / "d"
    kiln.cli.main(["data", "tokenize", "--tokenizer", str(tok), str(src), "--out", str(out)])
    shard = out / "train_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    return ["data", "inspect", str(out)], ["train_000000.bin"]


def _row_run_unknown_key(tmp: Path, tok: Path) -> tuple[list[str], list[str]]:
    config = tmp / "p.toml"
    config.write_text(
        f'[[sources]]\nname = "s"\npaths = ["x"]\nshear = 1\n[tokenize]\ntokenizer = "{tok}"\n'
    )
    return ["data", "run", str(config), "--out", str(tmp / "o")], ["shear"]


def _row_task_bad_line(tmp: Path, tok: Path) -> tuple[list[str], list[str]]:
    (tmp / "piqa.jsonl").write_text('{"goal": "x"\n')
    argv = ["eval", str(tmp / "no-model"), "--tasks", "piqa", "--data-dir", str(tmp)]
    return argv, ["piqa.jsonl"]


@pytest.mark.parametrize(
    "row",
    [
        _row_missing_input,
        _row_bad_jsonl,
        _row_not_a_dataset,
        _row_truncated_shard,
        _row_run_unknown_key,
        _row_task_bad_line,
    ],
    ids=lambda row: row.__name__.removeprefix("_row_"),
)
def test_bad_input_table(capsys, tmp_path, tiny_tokenizer_file, row) -> None:
    argv, names = row(tmp_path, tiny_tokenizer_file)
    capsys.readouterr()
    code, err = _main([*argv, *(["--quiet"] if argv[:2] == ["data", "tokenize"] else [])], capsys)
    assert_one_clear_line(code, err, *names)


def test_out_of_range_ids_in_the_bytes_stop_the_loader_when_verification_is_off(
    build_dataset, monkeypatch
) -> None:
    """The manifest's recorded max_id is in range, so opening can't tell; the loader can."""
    from kiln.data.loader import Loader

    root = build_dataset()
    poke_token(first_bin(root), 3, 65_535)
    monkeypatch.setenv("KILN_VERIFY_SHARDS", "0")
    ds = Dataset.open(root)
    loader = Loader(ds, "train", seq_len=4, batch_size=2)
    with pytest.raises(KilnError, match=r"train_000000\.bin: token 3 is id 65535, outside"):
        for _ in range(loader.n_windows):  # two epochs at least: every window is read
            loader.next_batch()


def test_inspect_without_verification_names_the_shard_of_an_out_of_range_id(
    capsys, build_dataset
) -> None:
    root = build_dataset()
    poke_token(first_bin(root), 0, 65_535)  # in the sample document (document 0)
    code, err = _main(["data", "inspect", str(root), "--no-verify"], capsys)
    assert_one_clear_line(code, err, "train_000000.bin", "token 0 is id 65535")


# ----------------------------------------------------------------- wording of the errors


def test_a_json_error_gives_the_whole_reason_with_line_and_column(
    capsys, tmp_path, tiny_tokenizer_file
) -> None:
    from kiln.data.pipeline.read.readers import ReadIssues, iter_records

    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "a\tb"}\n{"text": "cut')  # no final newline
    argv = ["data", "tokenize", "--tokenizer", str(tiny_tokenizer_file), str(bad)]
    code, err = _main([*argv, "--out", str(tmp_path / "d"), "--quiet"], capsys)
    line = assert_one_clear_line(code, err, f"{bad}:2")
    assert "(Invalid control character at line 2 column 12)" in line, line
    # `kiln data run` counts bad lines instead of stopping; its examples say the same.
    issues = ReadIssues()
    assert [d is None for d in iter_records(str(bad), "jsonl", issues=issues)] == [0, 1, 1]
    details = [ReadIssues.format_example(ex) for ex in issues.examples]
    assert details[1].endswith("(Unterminated string starting at line 3 column 10)"), details


def test_a_path_of_the_wrong_kind_is_named_as_such(capsys, tmp_path, tiny_tokenizer_file) -> None:
    code, err = _main(["data", "inspect", str(tiny_tokenizer_file)], capsys)
    assert_one_clear_line(code, err, f"{tiny_tokenizer_file}: is a file, expected a dataset")
    src = tmp_path / "a.txt"
    src.write_bytes(_text(5))
    argv = ["data", "tokenize", "--tokenizer", str(tmp_path), str(src), "--quiet"]
    code, err = _main([*argv, "--out", str(tmp_path / "d")], capsys)
    assert_one_clear_line(code, err, f"{tmp_path}: is a directory, expected a tokenizer file")
    code, err = _main(["data", "inspect", str(tmp_path / "nowhere")], capsys)
    assert_one_clear_line(code, err, "nowhere: no such dataset directory")


def test_a_bad_number_names_the_config_file_or_the_flag(
    capsys, tmp_path, tiny_tokenizer_file
) -> None:
    src = tmp_path / "a.txt"
    src.write_bytes(_text(5))
    config = tmp_path / "p.toml"
    config.write_text(
        f'docs_per_task = -5\n[[sources]]\nname = "s"\npaths = ["{src}"]\n'
        f'[tokenize]\ntokenizer = "{tiny_tokenizer_file}"\n',
        encoding="utf-8",
    )
    code, err = _main(["data", "run", str(config), "--out", str(tmp_path / "o")], capsys)
    assert_one_clear_line(code, err, f"{config}: docs_per_task = -5: expected >= 1")
    argv = ["data", "tokenize", "--tokenizer", str(tiny_tokenizer_file), str(src), "--quiet"]
    code, err = _main([*argv, "--out", str(tmp_path / "d"), "--val-fraction", "1.5"], capsys)
    assert_one_clear_line(code, err, "--val-fraction 1.5: expected a fraction in [0, 1)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "p.toml"]
