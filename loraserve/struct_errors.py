"""msgspec's validation errors as `InvalidRequestError`s naming the field, so a record built with
`msgspec.convert` or decoded from msgpack refuses a value in the words a client reads: the error's path
`$.sampling.temperature` names the field `sampling.temperature` (list indices dropped: `$.stop[2]` is
`stop`), or another name an edge gives it (`names`).

A string whose bytes are not UTF-8 is a `UnicodeDecodeError` from msgspec up to 0.22 and a `DecodeError`
("Invalid UTF-8 encoded string") from 0.23 on: every decoder of bytes from outside the process catches both
(`DECODE_ERRORS`) and says what is wrong with `decode_problem`, in the same words under either version."""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from loraserve.errors import InvalidRequestError

DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError)  # a ValidationError is a DecodeError
NOT_UTF8 = "Invalid UTF-8"  # how msgspec >= 0.23's DecodeError for such a string begins
_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_INDEX = re.compile(r"\[[^\]]*\]")


def invalid_field(
    error: msgspec.ValidationError, names: Mapping[str, str] | None = None, whole: str = "request"
) -> InvalidRequestError:
    """`error` as an InvalidRequestError: the field its path names, renamed by `names` (path -> field the
    client knows); `whole` when it names none (an unknown field, the record itself of the wrong type)."""
    message = str(error)
    at = _AT.search(message)
    if at is None:
        return InvalidRequestError(whole, message)
    path = _INDEX.sub("", at["path"]).lstrip(".") or whole
    return InvalidRequestError((names or {}).get(path, path), message[: at.start()])


def decode_problem(error: Exception, not_decodable: str = "") -> str:
    """What is wrong with bytes a msgspec decoder refused (one of `DECODE_ERRORS`); `not_decodable` goes
    before any other error's message (`wire.decode` passes it after catching ValidationErrors apart)."""
    if isinstance(error, UnicodeDecodeError):
        return f"holds a string that is not UTF-8 ({error.reason} at byte {error.start} of it)"
    if str(error).startswith(NOT_UTF8):
        return "holds a string that is not UTF-8"
    return f"{not_decodable}{error}"
