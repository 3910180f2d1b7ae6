"""The model's tokenizer (Hugging Face `tokenizers`, from tokenizer.json) and streaming detokenization."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from loraserve.errors import InvalidModelError
from loraserve.model_config import read_json_object, token_ids


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, eos_token_ids: tuple[int, ...], bos_token_id: int | None):
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise InvalidModelError(f"{model_dir} has no tokenizer.json (a `tokenizers` file is required)")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise InvalidModelError(f"{path} could not be read: {e}") from None
        return cls(tok, *_special_ids(model_dir, tok))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def special_ids(self) -> frozenset[int]:
        """Ids of special tokens: EOS, BOS and every added token marked special (`<unk>`, `<|im_start|>`, ...)."""
        added = self._tok.get_added_tokens_decoder()
        bos = () if self.bos_token_id is None else (self.bos_token_id,)
        return frozenset((*self.eos_token_ids, *bos, *(i for i, token in added.items() if token.special)))

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (what llguidance reads)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode_in_thread(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, letting other threads run meanwhile: `tokenizers` releases the GIL in `encode_batch`
        (its `encode` holds it throughout). For a thread other than an event loop's."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode_in_thread(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """`decode`, letting other threads run meanwhile (`decode_batch` releases the GIL, `decode` does not)."""
        return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def longest_token_bytes(self) -> int | None:
        """The most bytes of input text one token can stand for, or None where nothing bounds it.

        The longest, in UTF-8, of every token's string and of its text decoded alone (added tokens
        included), times 3 when a normalizer may compose or case-fold characters first (NFC, NFKC,
        Lowercase: at most 3 bytes of input become 1). So a text of more than `n` times this many bytes
        cannot be `n` tokens or fewer. None when one token may stand for any length of text: a model
        with an unknown token and no byte fallback (one `[UNK]` for a whole word), or a normalizer that
        may delete characters (accent stripping) or that is not known here. Reads the whole
        vocabulary: call it once."""
        spec = json.loads(self._tok.to_str())
        model = spec.get("model") or {}
        if model.get("unk_token") is not None and not model.get("byte_fallback", False):
            return None
        factor = _normalizer_shrink(spec.get("normalizer"))
        if factor is None:
            return None
        vocab = sorted(self._tok.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
        texts = self._tok.decode_batch([[i] for _, i in vocab], skip_special_tokens=False)
        longest = max(
            (max(len(token.encode()), len(text.encode())) for (token, _), text in zip(vocab, texts, strict=True)),
            default=1,
        )
        return longest * factor

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self._tok.id_to_token(i) or "" for i in ids]


# Normalizers by how many bytes of input may become one byte of what the model tokenizes (None: any).
_GROWING = frozenset({"Prepend", "Replace", "NFD", "NFKD"})  # keep or add bytes (Replace: the ' '->'▁' rule)
_COMPOSING = frozenset({"NFC", "NFKC", "Lowercase"})  # 3 bytes of input at most per byte (Hangul jamo, ẞ->ß)


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    """At most how many input bytes `normalizer` (tokenizer.json's) turns into one; None if unbounded or unknown."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind == "Replace":  # only a rule that maps one character to one or more keeps the bound
        pattern, content = normalizer.get("pattern", {}).get("String"), normalizer.get("content", "")
        return (
            1 if pattern is not None and len(pattern) == 1 and len(content.encode()) >= len(pattern.encode()) else None
        )
    if kind in _GROWING:
        return 1
    return 3 if kind in _COMPOSING else None


def _special_ids(model_dir: Path, tok: HFTokenizer) -> tuple[tuple[int, ...], int | None]:
    """EOS ids from generation_config.json, else config.json, else tokenizer_config.json's eos_token."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        raw = read_json_object(path, missing_ok=True)
        eos = raw.get("eos_token_id")
        if eos is not None:
            bos = token_ids(raw.get("bos_token_id"), f"{path}: bos_token_id")
            return token_ids(eos, f"{path}: eos_token_id"), (bos[0] if bos else None)
    raw = read_json_object(model_dir / "tokenizer_config.json", missing_ok=True)
    eos = tok.token_to_id(raw["eos_token"]) if isinstance(raw.get("eos_token"), str) else None
    bos = tok.token_to_id(raw["bos_token"]) if isinstance(raw.get("bos_token"), str) else None
    return ((eos,) if eos is not None else ()), bos


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, holding back incomplete UTF-8 characters.

    Decodes a short window of recent tokens twice (with and without the newest) and emits the
    difference once it no longer ends in a replacement character, so a character split over
    several byte-level tokens appears whole, and leading-space rules see their context.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], context: int = 4, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-context:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            piece = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += piece
            return piece
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end of generation)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        piece = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += piece
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
