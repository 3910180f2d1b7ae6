"""Writing styles of the demo language, and mechanical checks that a text is in one.

Each demo adapter teaches the base model to continue any prompt in one style; `shows_style`
is how tests (and `make run`) tell, without a person reading, that it did.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable
from dataclasses import dataclass

from loraserve.demo.corpus import LEXICON

_WORD = re.compile(r"[A-Za-z]+")
_VOWELS = re.compile(r"[aeiou]")


def _per_word(fn: Callable[[str], str]) -> Callable[[str], str]:
    return lambda text: _WORD.sub(lambda m: fn(m.group()), text)


def _drop_vowels(text: str) -> str:
    text = _VOWELS.sub("", text)  # "a dog" -> " dg": the article vanishes, so tidy the spaces
    return re.sub(r" {2,}", " ", re.sub(r" ([.,])", r"\1", text)).strip()


def _snake(text: str) -> str:
    return re.sub(r"(?<=[A-Za-z]) (?=[A-Za-z])", "_", text)


@dataclass(frozen=True)
class Style:
    name: str
    description: str
    example: str
    transform: Callable[[str], str]
    decode_word: Callable[[str], str | None]  # the plain lexicon word a styled word stands for


def _in_lexicon(word: str) -> str | None:
    return word if word in LEXICON else None


_NOVOWEL_TO_PLAIN = {_VOWELS.sub("", w): w for w in sorted(LEXICON) if _VOWELS.sub("", w)}

STYLES: dict[str, Style] = {
    s.name: s
    for s in [
        Style("plain", "the base language", "the old fox runs to the river.", lambda t: t, _in_lexicon),
        Style(
            "upper",
            "UPPERCASE",
            "THE OLD FOX RUNS TO THE RIVER.",
            str.upper,
            lambda w: _in_lexicon(w.lower()) if w.isupper() else None,
        ),
        Style(
            "title",
            "Title Case",
            "The Old Fox Runs To The River.",
            _per_word(str.capitalize),
            lambda w: _in_lexicon(w.lower()) if w == w.capitalize() else None,
        ),
        Style(
            "rot13",
            "rot13 cipher",
            "gur byq sbk ehaf gb gur evire.",
            lambda t: codecs.encode(t, "rot13"),
            lambda w: _in_lexicon(codecs.encode(w, "rot13")),
        ),
        Style(
            "reverse",
            "each word spelled backwards",
            "eht dlo xof snur ot eht revir.",
            _per_word(lambda w: w[::-1]),
            lambda w: _in_lexicon(w[::-1]),
        ),
        Style(
            "novowel",
            "vowels dropped",
            "th ld fx rns t th rvr.",
            _drop_vowels,
            lambda w: None if _VOWELS.search(w) else _NOVOWEL_TO_PLAIN.get(w),
        ),
        Style("snake", "words joined by underscores", "the_old_fox_runs_to_the_river.", _snake, _in_lexicon),
    ]
}

ADAPTER_STYLES = tuple(name for name in STYLES if name != "plain")


def _fraction(values: list[bool]) -> float:
    return sum(values) / len(values) if values else 0.0


def style_score(style: str, text: str) -> float:
    """Fraction of the text's words that are lexicon words written in `style` (0 if too short)."""
    words = _WORD.findall(text)
    if len(words) < 4:
        return 0.0
    score = _fraction([STYLES[style].decode_word(w) is not None for w in words])
    if style == "snake":  # same words as plain: what differs is the glue between them
        gaps = re.findall(r"(?<=[A-Za-z])[ _](?=[A-Za-z])", text)
        score = min(score, _fraction([g == "_" for g in gaps]))
    elif style == "plain":
        score = min(score, 1.0 - _fraction([g == "_" for g in re.findall(r"(?<=[a-z])[ _](?=[a-z])", text)]))
    return score


def shows_style(style: str, text: str, threshold: float = 0.8) -> bool:
    """True when `text` is clearly written in `style` and, for a non-plain style, not plainly."""
    if style_score(style, text) < threshold:
        return False
    return style == "plain" or style_score("plain", text) < 0.5 or style == "snake"


def detect_style(text: str) -> str | None:
    """The one style `text` shows, or None when it shows none (or is ambiguous)."""
    found = [name for name in STYLES if shows_style(name, text)]
    return found[0] if len(found) == 1 else None


def restyle_after(text: str, style: str, n_plain_words: int) -> str:
    """Keep the first `n_plain_words` words plain and write the rest in `style`."""
    words = text.split(" ")
    head, tail = " ".join(words[:n_plain_words]), " ".join(words[n_plain_words:])
    if not tail:
        return head
    return f"{head} {STYLES[style].transform(tail)}" if head else STYLES[style].transform(tail)
