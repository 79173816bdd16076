"""LLM: the offline Python API (``from kvledger import LLM, SamplingParams``).

A thin loop over :class:`LLMEngine`: add every prompt, step until all finish, return the final
outputs in prompt order. All prompts run as one continuous batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.engine.output.request_output import RequestOutput
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError

Prompt = str | list[int] | list[dict]


class LLM:
    """An engine over one model for batch generation.

    Args:
        model: ``"default"`` (bundled SmolLM2-135M-Instruct), a GGUF file or an HF folder.
        dtype: ``"bf16"`` (the fast mode: weights in the formats the kernel probe chose) or
            ``"fp32"`` (dense fp32 weights, exact against transformers).
        **options: any other :class:`EngineConfig` field (block_size, kv_cache_gib, ...).

    Attributes:
        tokenizer: the model's transformers tokenizer (with its chat template).
        engine: the underlying LLMEngine (``engine.stats()`` for KV figures).
    """

    def __init__(self, model: str = "default", dtype: str = "bf16", **options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, **options))
        self.tokenizer = self.engine.tokenizer
        self._counter = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit)."""
        self.engine.close()

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Final outputs, one per prompt, in order.

        A prompt is a string, a list of token ids, or a list of chat messages; pass one prompt
        or a list of them. Raises what :meth:`LLMEngine.add_request` raises (nothing is left
        queued when it does).
        """
        final: dict[str, RequestOutput] = {}
        ids: list[str] = []
        for out in self.stream(prompts, sampling_params, ids):
            if out.finished:
                final[out.request_id] = out
        return [final[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None
             ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (``{"role", "content"}`` dicts) or a list of
        them, each through the model's chat template with the generation prompt appended.

        Raises:
            InvalidParameterError: ``messages`` is neither, or what :meth:`generate` raises.
        """
        one = isinstance(messages, list) and messages and all(isinstance(m, dict)
                                                              for m in messages)
        many = isinstance(messages, list) and messages and all(
            isinstance(c, list) and c and all(isinstance(m, dict) for m in c) for c in messages)
        if not (one or many):
            raise InvalidParameterError(
                "chat() takes a conversation (a list of {'role': ..., 'content': ...} dicts) "
                "or a list of conversations")
        return self.generate(messages, sampling_params)

    def stream(self, prompts: Prompt | list[Prompt],
               sampling_params: SamplingParams | list[SamplingParams] | None = None,
               request_ids: list[str] | None = None) -> Iterator[RequestOutput]:
        """Yield every step's outputs (deltas in ``new_text``) until all prompts finish.

        ``request_ids``, if given, is filled with the ids assigned to the prompts, in order.
        """
        batch = [prompts] if _is_single(prompts) else list(prompts)
        params = sampling_params if isinstance(sampling_params, list | tuple) else (
            [SamplingParams() if sampling_params is None else sampling_params] * len(batch))
        if len(params) != len(batch):
            raise InvalidParameterError(
                f"got {len(batch)} prompts but {len(params)} SamplingParams; give one "
                "SamplingParams for all, or one per prompt")
        ids = request_ids if request_ids is not None else []
        start = len(ids)
        try:
            for prompt, p in zip(batch, params, strict=True):
                ids.append(f"offline-{next(self._counter)}")
                self.engine.add_request(ids[-1], prompt, p)
            while self.engine.has_unfinished_requests():
                yield from self.engine.step()
        finally:  # an error (or a caller that stops iterating) leaves nothing queued
            for rid in ids[start:]:
                self.engine.abort(rid)


def _is_single(prompts) -> bool:
    if not isinstance(prompts, list | tuple):
        return True  # a string, or something encode_prompt will refuse clearly
    return bool(prompts) and all(isinstance(p, int | dict) for p in prompts)
