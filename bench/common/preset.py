"""The sizes a suite runs at: every suite's preset subclasses `Preset` (a frozen dataclass of its fields),
with a full instance and a `--quick` one; a suite's flags replace single fields.

    preset = (QUICK if args.quick else FULL).but(n=args.choices_n)   # a flag left None keeps the preset's
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Self


@dataclass(frozen=True)
class Preset:
    """The base of every suite's preset."""

    def but(self, **values: object) -> Self:
        """This preset with each value given, unless None, in place of its field of that name."""
        return dataclasses.replace(self, **{k: v for k, v in values.items() if v is not None})
