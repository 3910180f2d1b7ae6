"""The README's Python examples, extracted so tests can run them as a reader would."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
README_API_ADDRESS = "127.0.0.1:50051"


def python_example(containing: str) -> str:
    """The one ```python block of the README whose text contains `containing`."""
    blocks = [b for b in FENCE.findall(README.read_text()) if containing in b]
    assert len(blocks) == 1, f"expected one README python block containing {containing!r}, found {len(blocks)}"
    return blocks[0]
