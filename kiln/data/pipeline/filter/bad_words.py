"""C4's bad-words rule: remove a page that contains a word of the LDNOOBW list of its language.

C4 (Raffel et al. 2020, Sec. 2.2) discarded "any page that contained any word on the List of
Dirty, Naughty, Obscene or Otherwise Bad Words"; TensorFlow Datasets built it from the English
list at LDNOOBW commit 25e679f03d96baa721cde20db9944649e8d0a844, matching a word only where it
is not inside a longer word (a non-word character or the text's edge on both sides). kiln ships
that English list and, for the other languages, the lists at commit
5faf2ba42d7b1c0977169ec3611df25a3c08eb13 (the one datatrove's C4BadWordsFilter uses) in
`kiln/assets/ldnoobw/` (CC BY 4.0; see the README there). For languages written without spaces
(ja, th, zh) a word matches anywhere, as datatrove does. A page's language is `meta["lang"]`
from the language stage, or `default_language` when that stage is off.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kiln.data.pipeline.document import Document
from kiln.errors import KilnError

LIST_DIR = Path(__file__).resolve().parents[3] / "assets" / "ldnoobw"
UNSPACED = frozenset({"ja", "th", "zh"})


def shipped_languages() -> tuple[str, ...]:
    """The languages kiln ships an LDNOOBW list for."""
    return tuple(sorted(p.stem for p in LIST_DIR.glob("*.txt")))


def read_word_list(path: Path, where: str) -> tuple[str, ...]:
    """The lowercased, non-empty lines of a word-list file."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise KilnError(f"{where} = {str(path)!r}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise KilnError(f"{where} = {str(path)!r}: not UTF-8 ({e.reason})") from None
    words = tuple(sorted({w for w in (line.strip().lower() for line in lines) if w}))
    if not words:
        raise KilnError(f"{where} = {str(path)!r}: no words in it")
    return words


def word_pattern(words: tuple[str, ...], unspaced: bool) -> re.Pattern[str]:
    """A regex matching any of `words`, as a whole word unless the language has no spaces."""
    alternatives = "|".join(re.escape(w) for w in sorted(words, key=lambda w: (-len(w), w)))
    if unspaced:
        return re.compile(f"(?:{alternatives})")
    return re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)")


@dataclass(frozen=True)
class BadWordsConfig:
    """Which word lists apply; off by default (C4 ran it, FineWeb and Gopher do not)."""

    enabled: bool = False
    languages: tuple[str, ...] = ()  # lists to apply; () = every shipped list
    words_file: str = ""  # one word per line: used for every language instead of LDNOOBW
    default_language: str = "en"  # for documents the language stage did not annotate
    allow: tuple[str, ...] = ()  # words removed from the lists (say, medical terms)

    def __post_init__(self) -> None:
        if not self.enabled or self.words_file:
            return
        unknown = sorted(set(self.languages) - set(shipped_languages()))
        if unknown:
            raise KilnError(
                f"[bad_words] languages: no LDNOOBW list for {unknown}; kiln ships "
                f"{', '.join(shipped_languages())} (or give words_file)"
            )


class BadWordsFilter:
    """Removes a page containing a listed word; the match count is its score."""

    name = "bad_words"

    def __init__(self, config: BadWordsConfig) -> None:
        self.config = config
        allow = {w.lower() for w in config.allow}
        self._patterns: dict[str, re.Pattern[str]] = {}
        self._custom: re.Pattern[str] | None = None
        if config.words_file:
            words = read_word_list(Path(config.words_file), "bad_words.words_file")
            self._custom = word_pattern(tuple(w for w in words if w not in allow), False)
            return
        for lang in config.languages or shipped_languages():
            words = read_word_list(LIST_DIR / f"{lang}.txt", f"bad_words list {lang}")
            words = tuple(w for w in words if w not in allow)
            if words:
                self._patterns[lang] = word_pattern(words, lang in UNSPACED)

    def apply(self, doc: Document) -> str | None:
        """Remove `doc` if a word of its language's list occurs in it (no list: kept)."""
        lang = doc.meta.get("lang") or self.config.default_language
        pattern = self._custom or self._patterns.get(lang)
        if pattern is None:
            return None
        lower = doc.text.lower()
        first = pattern.search(lower)
        if first is None:
            return None
        doc.meta.setdefault("scores", {})["bad_words"] = 1 + sum(
            1 for _ in pattern.finditer(lower, first.end())
        )
        doc.meta["bad_word"] = first.group()
        return f"bad_words.{lang}"
