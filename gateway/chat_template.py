"""The model's chat template: a conversation (OpenAI `messages`) -> the prompt text the model was tuned on.

Read as transformers reads it: `chat_template.jinja` beside the tokenizer, else `chat_template` in
`chat_template.json` or `tokenizer_config.json` (a string, or a list of named templates, of which
"default" is used). Rendered as `apply_chat_template` renders it: a sandboxed, immutable Jinja
environment (a template comes with the model, not from us) with `trim_blocks`/`lstrip_blocks`,
`loopcontrols`, the `tojson` filter and the `raise_exception` and `strftime_now` globals, given
`messages`, `tools`, `add_generation_prompt=True`, `bos_token` and `eos_token`. The text it renders carries its
own special tokens, so it is tokenized without adding any.

A model without a template has no chat format: a chat request for it is refused (InvalidRequestError
naming `messages`), never guessed at.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from loraserve.errors import InvalidModelError, InvalidRequestError
from loraserve.model_config import read_json_object, read_model_text


class ChatTemplate:
    """One compiled template and the special-token strings it may refer to."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise InvalidModelError(f"the model's chat template does not compile: {e}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template of the model in `model_dir`, or None when it has none."""
        model_dir = Path(model_dir)
        config = read_json_object(model_dir / "tokenizer_config.json", missing_ok=True)
        source: Any = None
        if (model_dir / "chat_template.jinja").is_file():
            source = read_model_text(model_dir / "chat_template.jinja")
        else:
            templates = read_json_object(model_dir / "chat_template.json", missing_ok=True)
            source = templates.get("chat_template") or config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            source = next(
                (t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None
            )
        if not isinstance(source, str) or not source.strip():
            return None
        return cls(source, _token(config.get("bos_token")), _token(config.get("eos_token")))

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt for `messages` (each a dict with `role` and `content`), ready for the assistant's turn;
        `tools` (OpenAI's `tools` entries) are the template's `tools`, as transformers passes them."""
        import jinja2

        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:  # raise_exception() included: the template refuses this conversation
            raise InvalidRequestError("messages", f"the model's chat template refused them: {e}") from None


def _token(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)
