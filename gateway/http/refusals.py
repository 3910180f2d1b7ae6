"""What the OpenAI edge does not implement, by name: vLLM's extensions and OpenAI's fields for features
loraserve does not have. Each is accepted at the values that ask for nothing — null, or what loraserve
does anyway (vLLM's defaults: `use_beam_search: false`, `min_tokens: 0`, ...) — and refused with a 400
naming it otherwise, never ignored (`schemas._Generation.unsupported` applies the tables). Other
unknown fields are ignored, as OpenAI-compatible servers do. The README's table of refusals lists them.
"""

from __future__ import annotations

from typing import Any

NOT_SUPPORTED = "is not supported"
# Fields loraserve does not implement: name -> (the values that ask for nothing, why others are refused).
# null always asks for nothing. Other unknown fields are ignored, as OpenAI-compatible servers do.
NOT_IMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    # vLLM's sampling and text extensions
    "min_tokens": ((0,), NOT_SUPPORTED),
    "use_beam_search": ((False,), NOT_SUPPORTED),
    "length_penalty": ((1,), NOT_SUPPORTED),
    "bad_words": (([],), NOT_SUPPORTED),
    "allowed_token_ids": ((), NOT_SUPPORTED),
    "logits_processors": (([],), NOT_SUPPORTED),
    "prompt_logprobs": ((), "is not supported: prompt log-probabilities come with echo (completions)"),
    "truncate_prompt_tokens": ((), NOT_SUPPORTED),
    "spaces_between_special_tokens": ((), NOT_SUPPORTED),
    "return_tokens_as_token_ids": ((False,), NOT_SUPPORTED),
    "guided_whitespace_pattern": ((), "is not supported: JSON is written compactly"),
    "priority": ((0,), "is not supported: requests are scheduled by tenant fairness and deadlines"),
    # OpenAI's
    "prediction": ((), "is not supported (predicted outputs)"),
    "store": ((False,), "is not supported: loraserve keeps no completions"),
}
CHAT_NOT_IMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": (([],), "is not supported: use tools"),
    "function_call": ((), "is not supported: use tool_choice"),
    "audio": ((), "is not supported: text models only"),
    "modalities": ((["text"],), "is not supported: text models only"),
    "web_search_options": ((), NOT_SUPPORTED),
    "reasoning_effort": ((), NOT_SUPPORTED),
    # vLLM's chat extensions
    "echo": ((False,), "is not supported in chat (completions have it)"),
    "add_generation_prompt": ((True,), "is not supported: the template always opens the assistant's turn"),
    "continue_final_message": ((False,), NOT_SUPPORTED),
    "add_special_tokens": ((False,), "is not supported: the chat template writes the special tokens"),
    "chat_template": ((), "is not supported: the model's own template renders every conversation"),
    "chat_template_kwargs": (({},), NOT_SUPPORTED),
    "documents": ((), NOT_SUPPORTED),
}
COMPLETION_NOT_IMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "add_special_tokens": ((True,), "is not supported: a text prompt begins with BOS (send token ids to choose)"),
    "prompt_embeds": ((), NOT_SUPPORTED),
}


def asks_for_nothing(value: Any, nothing: tuple[Any, ...]) -> bool:
    """Whether `value` is null or one of `nothing` (a bool only equal to a bool: `0` is not `False`)."""
    return value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in nothing)
