"""encode_prompt's ``add_special_tokens`` (vLLM's /tokenize field) on a tokenizer that adds a
BOS token, built here with the ``tokenizers`` library (an independent implementation)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from kvledger.engine.prompts import encode_prompt
from kvledger.errors import InvalidParameterError

VOCAB = {"<s>": 0, "<unk>": 1, "hello": 2, "world": 3}


def _bos_tokenizer() -> PreTrainedTokenizerFast:
    raw = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", unk_token="<unk>")


def test_add_special_tokens_decides_the_bos():
    tokenizer = _bos_tokenizer()
    assert encode_prompt(tokenizer, "hello world", len(VOCAB)) == [0, 2, 3]
    assert encode_prompt(tokenizer, "hello world", len(VOCAB), add_special_tokens=False) == [2, 3]


def test_a_tokenizer_larger_than_the_model_is_refused_not_an_index_error():
    """Dummy weights of a 3-token model with a 4-token stand-in tokenizer: "world" is id 3."""
    tokenizer = _bos_tokenizer()
    assert encode_prompt(tokenizer, "hello", 3) == [0, 2]
    with pytest.raises(InvalidParameterError, match=r"token id 3, outside .*\[0, 3\)"):
        encode_prompt(tokenizer, "hello world", 3)
