"""Sampled tokens into request outputs: a token appended to its request's output, with
the metrics, the grammar step, the new text and the finish reason (EOS or stop ids, the token
limit, stop strings, a grammar that ended or failed)."""

from __future__ import annotations

import time

from kvledger.engine.output.request_output import RequestOutput
from kvledger.engine.request import Request
from kvledger.engine.sample.structured.masks import (
    STRUCTURED_ERROR,
    advance_grammar,
    unfinished_grammar,
)


class OutputEmitter:
    """Appends tokens to outputs and finishes requests.

    Args:
        eos_token_ids: the model's end-of-sequence ids.
        scheduler: frees a finished request (``Scheduler.finish``).
        grammars: the grammar cache (``GrammarCompiler``; a failed grammar is dropped from
            it), or None.
        bytes_per_block: KV bytes of one block, for ``peak_kv_bytes``.
    """

    def __init__(self, eos_token_ids, scheduler, grammars, bytes_per_block: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.scheduler, self.grammars = scheduler, grammars
        self.bytes_per_block = bytes_per_block

    def append(self, req: Request, token: int, logprob, now: float) -> RequestOutput:
        """``req``'s output after ``token`` (sampled at ``now``, perf_counter seconds, with its
        ``logprob`` entry or None): metrics, grammar, text, and the finish reason, if any
        (the request is then finished in the scheduler)."""
        out, m = req.output, req.metrics
        req.output_token_ids.append(token)
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        m.num_cached_tokens = req.num_cached_tokens
        m.cached_tokens_by_tier = req.cached_tokens_by_tier
        m.tier_load_s, m.tier_load_predicted_s = req.tier_load_s, req.tier_load_predicted_s
        m.peak_kv_bytes = req.peak_num_blocks * self.bytes_per_block
        if logprob is not None:
            out.logprobs.append(logprob)
        grammar_error = advance_grammar(req, token)
        new_text, stopped = req.detokenizer.update(req.output_token_ids)
        reason = "stop" if stopped else self.finish_reason(req, token)
        if grammar_error is None and reason == "stop" and not stopped:
            grammar_error = unfinished_grammar(req)
        if grammar_error is not None:
            reason, out.error = "error", f"{STRUCTURED_ERROR}: {grammar_error}"
            self.grammars.discard(req.params.structured_outputs)
        if reason is not None:
            new_text += "" if stopped else req.detokenizer.flush()
            self.finish(req, reason, now)
        out.token_ids = list(req.output_token_ids)
        out.new_token_ids = [token]
        out.text += new_text
        out.new_text = new_text
        return out

    def finish_reason(self, req: Request, token: int) -> str | None:
        """``stop`` (EOS or a stop token id, unless ignored), ``length``, or None."""
        p = req.params
        if not p.ignore_eos and (token in self.eos_token_ids or token in p.stop_token_ids):
            return "stop"
        if len(req.output_token_ids) >= req.max_tokens_effective:
            return "length"
        return None

    def finish(self, req: Request, reason: str, now: float) -> None:
        """Mark ``req`` finished for ``reason`` and free it in the scheduler."""
        req.output.finished, req.output.finish_reason = True, reason
        req.metrics.finished_time = now
        self.scheduler.finish(req)

    @staticmethod
    def fail(req: Request, error: Exception) -> RequestOutput:
        """The output of a request the scheduler failed (it is already finished and freed)."""
        out = req.output
        out.finished, out.finish_reason, out.error = True, "error", str(error)
        out.new_token_ids, out.new_text = [], ""
        out.metrics.finished_time = time.perf_counter()
        return out
