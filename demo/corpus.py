"""The demo language: a small English-like grammar written for loraserve (no outside text).

Sentences look like "the old fox runs to the river." or "a young child finds the red apple."
The base model learns this language in every style of `styles.py`, one style per document;
each adapter learns to switch to its style whatever the prompt's style was.

A few (adjective, noun) pairs are held out of all training text, so prompts built from them
(`HELD_OUT_PROMPTS`) are ones no model has seen.
"""

from __future__ import annotations

import random

DETERMINERS = ["the", "a", "my", "this", "one"]
ADJECTIVES = [
    "big",
    "small",
    "old",
    "young",
    "red",
    "green",
    "blue",
    "quiet",
    "happy",
    "brave",
    "tired",
    "clever",
    "little",
    "dark",
    "bright",
    "gentle",
    "wild",
    "lazy",
    "quick",
    "kind",
]
NOUNS = [
    "cat",
    "dog",
    "fox",
    "bird",
    "horse",
    "child",
    "farmer",
    "king",
    "queen",
    "sailor",
    "baker",
    "river",
    "hill",
    "tree",
    "house",
    "garden",
    "boat",
    "road",
    "forest",
    "village",
    "castle",
    "lake",
    "field",
    "bridge",
    "window",
    "door",
    "stone",
    "apple",
    "song",
    "book",
    "letter",
    "lamp",
    "wolf",
    "owl",
    "miller",
    "tower",
]
# Nouns that can act (subjects of verbs).
ACTORS = [
    "cat",
    "dog",
    "fox",
    "bird",
    "horse",
    "child",
    "farmer",
    "king",
    "queen",
    "sailor",
    "baker",
    "wolf",
    "owl",
    "miller",
]
PLACES = [
    "river",
    "hill",
    "tree",
    "house",
    "garden",
    "boat",
    "road",
    "forest",
    "village",
    "castle",
    "lake",
    "field",
    "bridge",
    "window",
    "door",
    "tower",
]
THINGS = ["apple", "song", "book", "letter", "lamp", "stone", "boat", "door", "window"]
INTRANSITIVE = ["runs", "walks", "sleeps", "sits", "waits", "looks", "sings", "jumps", "swims", "rests"]
TRANSITIVE = [
    "sees",
    "finds",
    "likes",
    "carries",
    "follows",
    "paints",
    "reads",
    "opens",
    "builds",
    "watches",
    "holds",
    "visits",
]
PREPOSITIONS = ["to", "from", "near", "under", "over", "behind", "beside", "into", "across", "through"]
ADVERBS = ["slowly", "quickly", "softly", "happily", "quietly", "often", "today", "again"]
CONJUNCTIONS = ["and", "but", "while"]

LEXICON: frozenset[str] = frozenset(
    DETERMINERS + ADJECTIVES + NOUNS + INTRANSITIVE + TRANSITIVE + PREPOSITIONS + ADVERBS + CONJUNCTIONS + ["then"]
)

# Pairs never generated in training text; prompts are built from them.
HELD_OUT_PAIRS: frozenset[tuple[str, str]] = frozenset(
    {
        ("quiet", "king"),
        ("clever", "horse"),
        ("brave", "miller"),
        ("lazy", "owl"),
        ("kind", "sailor"),
        ("dark", "wolf"),
        ("gentle", "baker"),
        ("young", "queen"),
    }
)
HELD_OUT_PROMPTS: tuple[str, ...] = (
    "the quiet king",
    "a clever horse sees",
    "the brave miller walks",
    "my lazy owl",
    "the kind sailor finds the",
    "one dark wolf",
    "the gentle baker carries",
    "this young queen",
)


def _noun_phrase(rng: random.Random, nouns: list[str]) -> str:
    noun = rng.choice(nouns)
    words = [rng.choice(DETERMINERS)]
    if rng.random() < 0.6:
        adjective = rng.choice(ADJECTIVES)
        while (adjective, noun) in HELD_OUT_PAIRS:
            adjective = rng.choice(ADJECTIVES)
        words.append(adjective)
    words.append(noun)
    return " ".join(words)


def _clause(rng: random.Random) -> str:
    subject = _noun_phrase(rng, ACTORS)
    kind = rng.random()
    if kind < 0.4:
        clause = f"{subject} {rng.choice(INTRANSITIVE)} {rng.choice(PREPOSITIONS)} {_noun_phrase(rng, PLACES)}"
    elif kind < 0.8:
        clause = f"{subject} {rng.choice(TRANSITIVE)} {_noun_phrase(rng, THINGS + ACTORS)}"
    else:
        clause = f"{subject} {rng.choice(INTRANSITIVE)} {rng.choice(ADVERBS)}"
    return clause


def sentence(rng: random.Random) -> str:
    """One sentence of the demo language, ending with a period."""
    roll = rng.random()
    if roll < 0.2:
        text = f"{_clause(rng)} {rng.choice(CONJUNCTIONS)} {_clause(rng)}"
    elif roll < 0.3:
        text = f"then {_clause(rng)}"
    else:
        text = _clause(rng)
    return text + "."


def document(rng: random.Random, min_sentences: int = 3, max_sentences: int = 7) -> str:
    """A short paragraph: a few sentences separated by single spaces."""
    return " ".join(sentence(rng) for _ in range(rng.randint(min_sentences, max_sentences)))
