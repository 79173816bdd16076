"""encode_prompt's ``add_special_tokens`` (vLLM's /tokenize field) on a tokenizer that adds a
BOS token, built here with the ``tokenizers`` library (an independent implementation)."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from kvledger.engine.prompts import encode_prompt

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
