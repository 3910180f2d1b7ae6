"""msgspec's validation errors as `InvalidRequestError`s naming the field, so a record built with
`msgspec.convert` or decoded from msgpack refuses a value in the words a client reads: the error's path
`$.sampling.temperature` names the field `sampling.temperature` (list indices dropped: `$.stop[2]` is
`stop`), or another name an edge gives it (`names`).

msgspec's decoders raise `UnicodeDecodeError`, not a `DecodeError`, for a string whose bytes are not UTF-8:
every decoder of bytes from outside the process catches both (`DECODE_ERRORS`; `wire.decode` one by one)
and says what is wrong with `decode_problem`."""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from loraserve.errors import InvalidRequestError

DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError)  # a ValidationError is a DecodeError
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


def decode_problem(error: Exception) -> str:
    """What is wrong with bytes a msgspec decoder refused (one of `DECODE_ERRORS`)."""
    if isinstance(error, UnicodeDecodeError):
        return f"holds a string that is not UTF-8 ({error.reason} at byte {error.start} of it)"
    return str(error)
