"""Grammar masks: the packed layout, the allowed set against an independent oracle, and no
work for requests without a grammar."""

from __future__ import annotations

import torch

from kvledger.engine.request import Request
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.engine.sample.structured.constraint import StructuredOutputsParams
from kvledger.engine.sample.structured.masks import (
    advance_grammar,
    apply_grammar_masks,
    unpack_bitmask,
)

CHOICES = ["yes", "no"]


def test_unpack_reads_bit_t_mod_32_of_word_t_div_32():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=g, dtype=torch.int64)
    packed = packed.to(torch.int32)
    vocab = 100
    expected = [[bool((int(packed[r, t // 32]) & 0xFFFFFFFF) >> (t % 32) & 1)
                 for t in range(vocab)] for r in range(3)]
    assert unpack_bitmask(packed, vocab).tolist() == expected


def _request(grammars, constraint: StructuredOutputsParams | None) -> Request:
    req = Request("r", [1], SamplingParams())
    req.grammar = grammars.matcher(constraint) if constraint is not None else None
    return req


def test_choice_mask_allows_exactly_the_prefixes_of_the_choices(grammars, bundled_tokenizer):
    vocab = len(bundled_tokenizer)
    texts = [bundled_tokenizer.decode([t]) for t in range(vocab)]
    oracle = {t for t, s in enumerate(texts) if s and any(c.startswith(s) for c in CHOICES)}
    free = _request(grammars, None)
    choice = _request(grammars, StructuredOutputsParams(choice=CHOICES))
    logits = torch.zeros(2, vocab)
    out = apply_grammar_masks(logits, [free, choice], grammars)
    assert torch.equal(out[0], logits[0])  # the row without a grammar is untouched
    assert set(torch.nonzero(out[1] == 0).flatten().tolist()) == oracle
    assert torch.isinf(out[1]).sum() == vocab - len(oracle)


def test_a_finished_grammar_allows_only_eos_and_a_wrong_token_is_an_error(grammars,
                                                                          bundled_tokenizer):
    req = _request(grammars, StructuredOutputsParams(choice=CHOICES))
    for token in bundled_tokenizer.encode("yes", add_special_tokens=False):
        assert advance_grammar(req, token) is None
    out = apply_grammar_masks(torch.zeros(1, len(bundled_tokenizer)), [req], grammars)
    assert torch.nonzero(out[0] == 0).flatten().tolist() == [bundled_tokenizer.eos_token_id]
    wrong = _request(grammars, StructuredOutputsParams(choice=CHOICES))
    assert advance_grammar(wrong, bundled_tokenizer.encode("maybe")[0]) is not None


def test_a_batch_without_grammars_returns_the_logits_themselves(grammars):
    logits = torch.randn(3, 10)
    reqs = [_request(grammars, None) for _ in range(3)]
    assert apply_grammar_masks(logits, reqs, grammars) is logits
