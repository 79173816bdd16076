"""Prompt encoding: text, chat messages (through the model's chat template) or token ids."""

from __future__ import annotations

from kvledger.errors import InvalidParameterError


def encode_prompt(tokenizer, prompt: str | list[dict] | list[int], vocab_size: int,
                  add_special_tokens: bool = True,
                  tools: list[dict] | None = None) -> list[int]:
    """Token ids for a prompt.

    A ``str`` is tokenized as is (the tokenizer decides about BOS, unless
    ``add_special_tokens`` is False); a list of ``{"role", "content"}`` dicts goes through the
    chat template with the generation prompt appended (and ``tools``, OpenAI function
    declarations, for a template that renders them); a list of ints is used as given.

    Raises:
        InvalidParameterError: empty prompt, ids outside the vocabulary (given, or from a
            tokenizer larger than the model), malformed messages, or text given to a model
            loaded without a tokenizer.
    """
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise InvalidParameterError(
                f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        return list(prompt)
    if tokenizer is None:
        raise InvalidParameterError("this model has no tokenizer: give token ids")
    if isinstance(prompt, str):
        ids = _encode(tokenizer, prompt, add_special_tokens=add_special_tokens)
    elif isinstance(prompt, list) and prompt and all(_is_message(m) for m in prompt):
        try:
            text = tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 (jinja TemplateError, raise_exception(), ...)
            raise InvalidParameterError(f"the chat template rejected the messages: {exc}") from None
        ids = _encode(tokenizer, text, add_special_tokens=False)
    else:
        raise InvalidParameterError(
            "a prompt must be a non-empty string, a list of token ids, or a list of chat "
            "messages ({'role': ..., 'content': ...})")
    if not ids:
        raise InvalidParameterError("the prompt is empty")
    if max(ids) >= vocab_size:  # a stand-in tokenizer larger than the model (dummy weights)
        raise InvalidParameterError(
            f"the tokenizer gives token id {max(ids)}, outside the model's vocabulary "
            f"[0, {vocab_size}): give token ids, or load the model with its own tokenizer")
    return ids


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except (TypeError, ValueError, UnicodeError) as exc:  # e.g. lone surrogates
        raise InvalidParameterError(f"the prompt cannot be tokenized: {exc}") from None


def _is_message(m) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(
        m.get("content"), str)
