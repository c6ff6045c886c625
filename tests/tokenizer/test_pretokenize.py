"""The native pre-tokenizer equals the `regex` module on the gpt2, cl100k and o200k patterns."""

from __future__ import annotations

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.tokenizer.native import NATIVE
from kiln.tokenizer.patterns import NAMED_PATTERNS

pytestmark = pytest.mark.skipif(NATIVE is None, reason="native extension not built")

# Characters that exercise every branch: each Unicode class the patterns name, case-folded
# contraction letters (U+017F folds to s), CR/LF, exotic whitespace, marks, digits of other
# scripts, emoji with ZWJ and modifiers.
TRICKY = list(
    "aAzZsStTrReEvVmMlLdD' \t\n\r\x0b\x0c\x1c\x85\xa0\u2028\u3000/._-!?\"0123"
    "\u017f\u212a\u0130\u01c5\u02b0\u05d0\u0661\u0e51\u2160\u00bd\u0301\u0903\u20dd"
    "éÉßñЖж中文字😀👍🏽\u200d❤️\U0001f1fa\U0001f1f8"
)
tricky_text = st.text(alphabet=st.sampled_from(TRICKY), max_size=60)
any_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=60)


def native_split(name: str, text: str) -> list[str]:
    data = text.encode("utf-8")
    return [data[b:e].decode("utf-8") for b, e in NATIVE.pretokenize(name, data)]


ADVERSARIAL = [
    "",
    " ",
    "   ",
    "a  b",
    "hello world\n\n\nfoo  \n  bar\r\n\r\n",
    "it's I'M we'Re 'll 'LL 'ſ 's'",
    "  123456789 12 1",
    "x\u2028\u2028y \u3000z",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467 family",
    "e\u0301\u0301 \u0301a",
    "ǅungla Ǆ ǆ",
    "'/path/to//file\n\n/",
    "مرحبا بالعالم",
    "\x00\x01 \x00",
    "ab" * 300,
]


@pytest.mark.parametrize("name", sorted(NAMED_PATTERNS))
@pytest.mark.parametrize("text", ADVERSARIAL)
def test_adversarial_texts(name: str, text: str) -> None:
    assert native_split(name, text) == regex.findall(NAMED_PATTERNS[name], text)


@pytest.mark.parametrize("name", sorted(NAMED_PATTERNS))
@settings(max_examples=300, deadline=None)
@given(text=tricky_text)
def test_tricky_alphabet(name: str, text: str) -> None:
    assert native_split(name, text) == regex.findall(NAMED_PATTERNS[name], text)


@pytest.mark.parametrize("name", sorted(NAMED_PATTERNS))
@settings(max_examples=200, deadline=None)
@given(text=any_text)
def test_any_unicode(name: str, text: str) -> None:
    assert native_split(name, text) == regex.findall(NAMED_PATTERNS[name], text)


def test_real_multilingual_corpus(shared_data) -> None:
    import gzip

    with gzip.open(shared_data / "bench" / "multi_10m.txt.gz", "rt", encoding="utf-8") as f:
        text = f.read(400_000)
    for name, pattern in NAMED_PATTERNS.items():
        assert native_split(name, text) == regex.findall(pattern, text), name
