"""loraserve: serve many LoRA adapters of one base LLM.

The role folders at the top of the repository (gateway/, scheduler/, adapter_store/, worker/,
launcher/, kernels/, bench/, demo/) are subpackages of `loraserve`: `worker/` is `loraserve.worker`. They
have no `__init__.py` — they are namespace portions — so a folder of this repo can never shadow an
installed package of the same name (Hugging Face's `kernels`, say) when Python runs from the
repository root. An installed wheel carries them inside `loraserve/`; in a source checkout the
repository root is added to this package's search path instead.
"""

from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "worker").is_dir() and str(_ROOT) not in __path__:
    __path__.append(str(_ROOT))
