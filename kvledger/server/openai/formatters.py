"""OpenAI response objects built from the engine's ``RequestOutput``\\ s.

Two formatters, one per endpoint and choice, with the same three methods: ``chunks(out)`` (the
stream chunks of one engine step), ``usage_chunk(outs)`` (the ``include_usage`` chunk, empty
``choices``, usage summed over the choices) and ``response(out, logprobs)`` (the whole
non-streamed body of one choice; :func:`merge_choices` joins several). Shapes follow the
OpenAI API reference: ``text_completion`` with legacy logprobs (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``) and ``chat.completion(.chunk)`` with ``logprobs.content``.

The first chat chunk carries only ``role``; it is emitted in the same ``chunks()`` call as the first
content, never earlier, so a client's TTFT measured on it is the real one. With tools
(``tool_parser`` set, :mod:`kvledger.server.tools.parser`) a reply's calls come back as
``message.tool_calls`` (``content`` null unless text preceded them) and ``finish_reason``
``tool_calls``; streamed, a call's first chunk carries ``index``, ``id``, ``type`` and
``function.name`` with empty ``arguments``, later chunks ``index`` and ``function.arguments``
fragments. A step whose tokens add no text and no logprobs (a held-back stop-string prefix) yields
no chunk. ``usage.completion_tokens`` is ``len(out.token_ids)``: every generated token is counted
once and (with logprobs on) appears once in the streamed logprobs.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from kvledger.engine.output.request_output import RequestOutput, TokenLogprob
from kvledger.server.tools.parser import ToolCallParser

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def step_logprobs(out: RequestOutput) -> list[TokenLogprob]:
    """The logprobs of this step's new tokens (whether the engine's list is cumulative or not)."""
    lps, n_new = out.logprobs or [], len(out.new_token_ids)
    return lps[len(lps) - n_new:] if n_new else []


def usage(outs: RequestOutput | list[RequestOutput]) -> dict:
    """OpenAI ``usage`` (tokens) summed over the choices, with the prefix-cache hits as
    ``cached_tokens``."""
    outs = outs if isinstance(outs, list) else [outs]
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(o.token_ids) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": cached_details([o.metrics for o in outs]),
    }


def cached_details(metrics: list) -> dict:
    """``{"cached_tokens": n}``, and when the engine runs KV tiers (docs/kv-tiers.md)
    ``cached_tokens_by_tier`` (``{"pool", "ram", "disk"}``, summing to it) with the tier loads'
    measured and predicted seconds (``kv_tier_load_seconds``,
    ``kv_tier_load_predicted_seconds``; 0 when nothing was loaded or no speed is known)."""
    out = {"cached_tokens": sum(m.num_cached_tokens for m in metrics)}
    tiers = [m for m in metrics if m.cached_tokens_by_tier]
    if tiers:
        by_tier = [m.cached_tokens_by_tier for m in tiers]
        out["cached_tokens_by_tier"] = {k: sum(t[k] for t in by_tier) for k in by_tier[0]}
        out["kv_tier_load_seconds"] = round(sum(m.tier_load_s for m in tiers), 6)
        out["kv_tier_load_predicted_seconds"] = round(
            sum(m.tier_load_predicted_s for m in tiers), 6)
    return out


def merge_choices(bodies: list[dict]) -> dict:
    """One response of several choices: the first body's envelope, every choice in index
    order, the bodies' usage summed."""
    merged = dict(bodies[0])
    merged["choices"] = sorted((b["choices"][0] for b in bodies), key=lambda c: c["index"])
    merged["usage"] = _sum_usage([b["usage"] for b in bodies])
    return merged


def _sum_usage(usages: list[dict]) -> dict:
    total = {key: sum(u[key] for u in usages)
             for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    details = [u["prompt_tokens_details"] for u in usages]
    total["prompt_tokens_details"] = {"cached_tokens": sum(d["cached_tokens"] for d in details)}
    tiers = [d for d in details if "cached_tokens_by_tier" in d]
    if tiers:
        summed = total["prompt_tokens_details"]
        summed["cached_tokens_by_tier"] = {k: sum(d["cached_tokens_by_tier"][k] for d in tiers)
                                           for k in tiers[0]["cached_tokens_by_tier"]}
        for key in ("kv_tier_load_seconds", "kv_tier_load_predicted_seconds"):
            summed[key] = round(sum(d[key] for d in tiers), 6)
    return total


def _clamp(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


class _Formatter:
    object_name = ""

    def __init__(self, request_id: str, model: str, tokenizer: Any, logprobs: bool,
                 index: int = 0, continuous_usage: bool = False,
                 tool_parser: ToolCallParser | None = None,
                 prompt_logprobs: bool = False) -> None:
        self.request_id = request_id
        self.prompt_logprobs = prompt_logprobs  # vLLM's field is in the response
        self._texts: dict[int, str] = {}  # token id -> text, decoded once per response
        self.index = index
        self.continuous_usage = continuous_usage  # every chunk carries the usage so far
        self.tool_parser = tool_parser  # when the request has tools (chat)
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.logprobs = logprobs

    def _envelope(self, choices: list[dict], obj: str | None = None) -> dict:
        return {"id": self.request_id, "object": obj or self.object_name,
                "created": self.created, "model": self.model, "choices": choices}

    def _with_usage(self, chunks: list[dict], out: RequestOutput) -> list[dict]:
        if self.continuous_usage:
            for chunk in chunks:
                chunk["usage"] = usage(out)
        return chunks

    def _token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _vllm_prompt_logprobs(self, out: RequestOutput) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: per prompt token null (the first), else a dict of the
        token then its top alternatives, ``{token id: {logprob, rank, decoded_token}}``."""
        return [None if lp is None else self._vllm_entry(lp) for lp in out.prompt_logprobs]

    def _vllm_entry(self, lp: TokenLogprob) -> dict:
        entry = {str(lp.token_id): {"logprob": _clamp(lp.logprob), "rank": lp.rank,
                                    "decoded_token": self._token_text(lp.token_id)}}
        for rank, (token, value) in enumerate(lp.top, start=1):
            entry.setdefault(str(token), {"logprob": _clamp(value), "rank": rank,
                                          "decoded_token": self._token_text(token)})
        return entry

    def usage_chunk(self, outs: RequestOutput | list[RequestOutput]) -> dict:
        """The single ``include_usage`` chunk: empty ``choices`` and the (summed) usage."""
        return {**self._envelope([], self.chunk_object), "usage": usage(outs)}


class CompletionFormatter(_Formatter):
    """``/v1/completions`` bodies and chunks (object ``text_completion``).

    ``echo``: the prompt's text and (with logprobs) its tokens come first, the first token's
    logprob and top alternatives null (vLLM's shape); ``prompt_only`` (``max_tokens: 0``):
    the prompt alone, no completion token counted; ``prompt_logprobs``: the choice carries
    vLLM's ``prompt_logprobs`` (per prompt token, null first, else ``{token id: {logprob,
    rank, decoded_token}}`` for the token and its top alternatives). Echo is not streamed.
    """

    object_name = chunk_object = "text_completion"

    def __init__(self, *args: Any, echo: bool = False, prompt_only: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.echo, self.prompt_only = echo, prompt_only
        self._text_offset = 0

    def _logprobs(self, lps: list[TokenLogprob | None], token_ids: list[int]) -> dict:
        tokens = [self._token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else _clamp(lp.logprob) for lp in lps],
            "top_logprobs": [None if lp is None else
                             {self._token_text(t): _clamp(v) for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def chunks(self, out: RequestOutput) -> list[dict]:
        """Stream chunks of one step (at most one)."""
        lps = step_logprobs(out) if self.logprobs else []
        if not (out.new_text or lps or out.finished):
            return []
        choice = {"index": self.index, "text": out.new_text,
                  "logprobs": self._logprobs(lps, [lp.token_id for lp in lps])
                  if self.logprobs else None,
                  "finish_reason": out.finish_reason if out.finished else None}
        return self._with_usage([self._envelope([choice])], out)

    def response(self, out: RequestOutput, lps: list[TokenLogprob]) -> dict:
        """The whole non-streamed body."""
        text, lps = ("", []) if self.prompt_only else (out.text, list(lps))
        token_ids = [lp.token_id for lp in lps]
        if self.echo:
            text = self.tokenizer.decode(out.prompt_token_ids) + text
            token_ids = out.prompt_token_ids + token_ids
            lps = (out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + lps
        choice = {"index": self.index, "text": text,
                  "logprobs": self._logprobs(lps, token_ids) if self.logprobs else None,
                  "finish_reason": out.finish_reason}
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(out)
        body = {**self._envelope([choice]), "usage": usage(out)}
        if self.prompt_only:
            body["usage"].update(completion_tokens=0,
                                 total_tokens=body["usage"]["prompt_tokens"])
        return body


class ChatFormatter(_Formatter):
    """``/v1/chat/completions`` bodies and chunks; with ``prompt_logprobs``, the body's
    top-level ``prompt_logprobs`` (vLLM's ``ChatCompletionResponse``) over the rendered
    prompt's tokens."""

    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._role_sent = False
        self._call_ids: list[str] = []

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self._token_text(token_id)
        return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode())}

    def _logprobs(self, lps: list[TokenLogprob]) -> dict:
        return {"content": [
            {**self._entry(lp.token_id, lp.logprob),
             "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]}

    def _chunk(self, delta: dict, logprobs: dict | None, finish: str | None) -> dict:
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish}
        return self._envelope([choice], self.chunk_object)

    def _finish_reason(self, out: RequestOutput) -> str | None:
        calls = self.tool_parser is not None and any(c.complete for c in self.tool_parser.calls)
        return "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason

    def _deltas(self, out: RequestOutput) -> list[dict]:
        """The deltas of one step: its text, or with tools the parser's events."""
        if self.tool_parser is None:
            return [{"content": out.new_text}] if out.new_text else []
        events = self.tool_parser.feed(out.new_text)
        if out.finished:
            events += self.tool_parser.finish()
        deltas = []
        for kind, *rest in events:
            if kind == "content":
                deltas.append({"content": rest[0]})
            elif kind == "call":
                self._call_ids.append(f"call_{uuid.uuid4().hex[:24]}")
                deltas.append({"tool_calls": [{"index": rest[0], "id": self._call_ids[-1],
                                               "type": "function", "function": {
                                                   "name": rest[1], "arguments": ""}}]})
            elif rest[1]:
                deltas.append({"tool_calls": [{"index": rest[0],
                                               "function": {"arguments": rest[1]}}]})
        return deltas

    def chunks(self, out: RequestOutput) -> list[dict]:
        """Stream chunks of one step; the first content comes right after the role chunk."""
        lps = step_logprobs(out) if self.logprobs else []
        deltas = self._deltas(out)
        if not (deltas or lps or out.finished):
            return []
        chunks = []
        if not self._role_sent:
            self._role_sent = True
            chunks.append(self._chunk({"role": "assistant", "content": ""}, None, None))
        deltas = deltas or [{}]
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            chunks.append(self._chunk(delta, self._logprobs(lps) if self.logprobs and i == 0
                                      else None,
                                      self._finish_reason(out) if out.finished and last else None))
        return self._with_usage(chunks, out)

    def _message(self, out: RequestOutput) -> dict:
        if self.tool_parser is None:
            return {"role": "assistant", "content": out.text}
        parser = self.tool_parser
        parser.feed(out.text)
        parser.finish()
        calls = [c for c in parser.calls if c.complete]
        if not calls:
            return {"role": "assistant", "content": parser.content}
        return {"role": "assistant", "content": parser.content if parser.content.strip() else None,
                "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}}
                               for c in calls]}

    def response(self, out: RequestOutput, lps: list[TokenLogprob]) -> dict:
        """The whole non-streamed body."""
        choice = {"index": self.index, "message": self._message(out),
                  "logprobs": self._logprobs(lps) if self.logprobs else None,
                  "finish_reason": self._finish_reason(out)}
        body = {**self._envelope([choice]), "usage": usage(out)}
        if self.prompt_logprobs:  # vLLM's chat response carries it at the top level
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(out)
        return body
