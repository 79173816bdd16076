"""Field types and the base model shared by every request body's nested objects."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


def _utf8(text: str) -> str:
    """Refuse lone surrogates: no tokenizer takes them and no UTF-8 reply can echo them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]


class _Part(BaseModel):
    """Nested objects: strict JSON types, finite numbers, unknown keys ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
