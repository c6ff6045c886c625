"""Incremental detokenisation: whole characters, stop strings held back and cut."""

from __future__ import annotations

from kiln.serve.engine.stop import TextStream


class Bytes:
    def __init__(self, table: dict[int, bytes]) -> None:
        self.table = table

    def decode_bytes(self, ids: list[int]) -> bytes:
        return b"".join(self.table[i] for i in ids)


def feed(stream: TextStream, pieces: list[bytes]) -> list[str]:
    tok = Bytes({i: p for i, p in enumerate(pieces)})
    stream.tokenizer = tok
    out = [stream.push(i) for i in range(len(pieces))]
    return [*out, stream.finish()]


def test_a_character_split_over_tokens_is_released_whole() -> None:
    euro = "€".encode()
    assert feed(TextStream(None), [b"a", euro[:1], euro[1:], b"b"]) == ["a", "", "€", "b", ""]


def test_a_stop_string_across_tokens_is_cut_and_never_released() -> None:
    stream = TextStream(None, ("END",))
    out = feed(stream, [b"ab", b"cE", b"N", b"Dxyz", b"more"])
    assert out == ["ab", "c", "", "", "", ""]
    assert stream.text == "abc" and stream.stopped


def test_held_text_that_turns_out_harmless_is_released() -> None:
    out = feed(TextStream(None, ("END",)), [b"aE", b"Nx", b"E"])
    assert out == ["a", "ENx", "", "E"]


def test_incomplete_utf8_at_the_end_becomes_a_replacement() -> None:
    assert feed(TextStream(None), [b"ok", "€".encode()[:2]]) == ["ok", "", "\ufffd"]
