"""The ``draft_model`` proposer: a second, smaller model with the target's vocabulary proposes
each proposing sequence's next tokens, in batched steps of its own before the target's step.

Its own paged KV: a block pool and a full-precision KV store (the compute dtype) of the
draft's shapes, as many blocks as the target's pool; the engine sizes the target's pool with
the draft's bytes per block added to its own (``engine.py``), so the memory the engine plans
holds both. Each sequence it proposes for has a :class:`DraftSequence`: its block table in
that pool and the tokens the draft has computed.

A step (:meth:`DraftModel.propose`): the draft first computes what it has not seen of each
sequence (the whole prompt and output at its first proposal, after that the tokens the last
verify emitted past what it had computed), a prefill segment or a decode each, in one batch,
and proposes its argmax; then up to ``k - 1`` batched decode steps, each computing the
previous proposal of the sequences that want more. The proposals are the draft's argmax, a
deterministic proposer, so the verifier's rule (``verify.py``: ``q`` one-hot at the proposal)
keeps the target's distribution at any temperature.

Rollback (:meth:`DraftModel.keep`): after the verify the draft keeps the K/V of its computed
tokens that are now the sequence's (its earlier tokens and the accepted proposals); the blocks
past them go back to its pool. A sequence that finished or is no longer running gives all its
blocks back (:meth:`DraftModel.release`, :meth:`DraftModel.retain`). Where the draft's pool has
no room for a sequence's next tokens, it proposes no more for it this step.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import NamedTuple

import torch

from kvledger.engine.kv.layout import KVLayout, resolve_format
from kvledger.engine.kv.pool import BlockPool
from kvledger.engine.kv.store import KV_FORMAT_OF_DTYPE
from kvledger.engine.model_load import build_model
from kvledger.engine.request import Request
from kvledger.engine.retention.full import FullRetention
from kvledger.engine.runner import ModelRunner
from kvledger.engine.sched.output import ScheduledChunk
from kvledger.errors import ConfigError, InvalidParameterError
from kvledger.ledger.kv_format import KVFormatSpec
from kvledger.ledger.kv_groups import kv_groups
from kvledger.spec import ModelSpec

log = logging.getLogger("kvledger.engine")


class LoadedDraft(NamedTuple):
    """A loaded draft model and the layout of its KV."""

    spec: ModelSpec
    weights: dict
    layout: KVLayout

    @property
    def bytes_per_block(self) -> int:
        return self.layout.bytes_per_block


def load_draft(config, dtype: torch.dtype, target: ModelSpec, tokenizer) -> LoadedDraft | None:
    """The draft model of an EngineConfig's ``speculative_config`` (None unless its method is
    ``draft_model``), loaded as the target is (``model/weights/loader.py``: a GGUF file, a
    Hugging Face folder or ``default``) in the target's compute dtype.

    Raises:
        InvalidParameterError: its vocabulary is not the target's (the sizes of both named),
            or it has sliding-window or state layers.
        ModelNotFoundError, ConfigError, UnsupportedModelError: as loading any model.
    """
    from kvledger.model.weights.loader import load_tokenizer, load_weights

    path = config.speculative.model
    if config.speculative.method != "draft_model":
        return None
    spec, weights = load_weights(path, dtype)
    if spec.vocab_size != target.vocab_size:
        raise InvalidParameterError(
            f"speculative_config model {path} has a vocabulary of {spec.vocab_size} tokens, the "
            f"target {target.name} one of {target.vocab_size}: a draft model must share the "
            "target's tokenizer")
    if tokenizer is not None:
        try:
            own = load_tokenizer(path)
        except ConfigError:  # a draft without tokenizer files: its vocabulary size matched
            own = None
        if own is not None and own.get_vocab() != tokenizer.get_vocab():
            raise InvalidParameterError(
                f"speculative_config model {path} has another tokenizer than the target "
                f"{target.name} ({len(own.get_vocab())} and {len(tokenizer.get_vocab())} "
                "entries, not the same token ids): a draft model must share the target's "
                "tokenizer")
    if len(kv_groups(spec)) > 1 or spec.state_layers:
        raise InvalidParameterError(
            f"speculative_config model {path} ({spec.model_type}) has sliding-window or state "
            "layers; a draft model runs with full attention layers only")
    return LoadedDraft(spec, weights, draft_layout(spec, dtype, config.block_size))


class DraftSequence:
    """A sequence as the draft model computes it: the target request's tokens, then the
    proposals of this step (``proposed``), over a block table in the draft's pool. Read by
    the runner as it reads a request (full retention, no prompt logprobs)."""

    retention = FullRetention()
    output = SimpleNamespace(prompt_logprobs=None)  # the runner asks for prompt logits

    def __init__(self, target: Request) -> None:
        self.target = target
        self.block_tables: list[list[int]] = [[]]
        self.num_computed_tokens = 0
        self.base = 0  # the target's tokens when this step's proposals began
        self.proposed: list[int] = []

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]

    @property
    def num_prompt_tokens(self) -> int:
        return self.target.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.base + len(self.proposed)

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of the target's first ``base`` tokens, then the proposals."""
        b = self.base
        return (self.target.token_ids_range(min(start, b), min(end, b))
                + self.proposed[max(start - b, 0): max(end - b, 0)])


class DraftModel:
    """The draft model, its KV pool and the sequences it proposes for (see the module
    docstring).

    Args:
        draft: the loaded draft (:func:`load_draft`; its KV is stored in the compute dtype).
        num_blocks: the target pool's.
        attention: the attention backend's name (None: the device's choice); device: the
            engine's tuned device.
    """

    def __init__(self, draft: LoadedDraft, num_blocks: int, attention: str | None,
                 device) -> None:
        spec, self.layout = draft.spec, draft.layout
        self.spec, self.block_size = spec, self.layout.block_size
        dtype = self.layout.compute_dtype
        self.model = build_model(spec, draft.weights, dtype,
                                 attention or device.attention_backend(spec, False),
                                 device=device)
        self.store = self.layout.build_store(num_blocks)
        self.pool = BlockPool(num_blocks)
        self.runner = ModelRunner(self.model, self.store, self.block_size)
        self.seqs: dict[str, DraftSequence] = {}
        self.steps = 0  # batched forwards run
        log.info("draft model: %s, KV %s, %d blocks of %d bytes", spec.name,
                 self.layout.kv_format, num_blocks, self.bytes_per_block)

    @property
    def bytes_per_block(self) -> int:
        return self.layout.bytes_per_block

    def propose(self, reqs: list[Request], rooms: list[int]) -> list[list[int]]:
        """Up to ``rooms[i]`` proposed tokens after each of ``reqs``."""
        seqs = [self._sequence(r) for r in reqs]
        wants = {}
        for s, room in zip(seqs, rooms):
            self._settle(s)
            # the draft computes positions up to base + room - 2 (its last proposal is not)
            room = min(room, self.spec.max_position_embeddings - s.base + 1)
            if room > 0:
                wants[id(s)] = room
        active = [s for s in seqs if id(s) in wants]
        while active:
            chunks = [ScheduledChunk(s, s.num_tokens - s.num_computed_tokens) for s in active
                      if self._allocate(s, s.num_tokens)]
            if not chunks:
                break
            logits = self.runner.execute(chunks)
            self.steps += 1
            for c, token in zip(chunks, logits.argmax(dim=-1).tolist()):
                c.request.num_computed_tokens = c.request.num_tokens
                c.request.proposed.append(token)
            active = [c.request for c in chunks if len(c.request.proposed) < wants[id(c.request)]]
        return [list(s.proposed) for s in seqs]

    def keep(self, req: Request) -> None:
        """After ``req``'s verify: keep the K/V of the computed tokens that are now its
        tokens, give back the blocks past them (all of them when it finished)."""
        s = self.seqs.get(req.request_id)
        if s is None or s.target is not req:
            return
        if req.is_finished:
            self.release(req.request_id)
        else:
            self._settle(s)

    def _settle(self, s: DraftSequence) -> None:
        """Cut ``s``'s computed tokens to its request's tokens short of the last one, the
        token the verify emitted after the accepted proposals (the draft computed only
        proposals, so what it computed before that position is the accepted ones; the last
        token's logits the next proposal needs), and give back the blocks past them."""
        s.num_computed_tokens = min(s.num_computed_tokens, s.target.num_tokens - 1)
        s.base, s.proposed = s.target.num_tokens, []
        keep = -(-s.num_computed_tokens // self.block_size)
        self.pool.free(reversed(s.block_table[keep:]))
        del s.block_table[keep:]

    def retain(self, running: list[Request]) -> None:
        """Give back the blocks of every sequence whose request is not in ``running``."""
        live = {id(r) for r in running}
        for rid in [rid for rid, s in self.seqs.items() if id(s.target) not in live]:
            self.release(rid)

    def release(self, request_id: str) -> None:
        """Give back all the blocks of ``request_id``'s sequence, if it has one."""
        s = self.seqs.pop(request_id, None)
        if s is not None:
            self.pool.free(reversed(s.block_table))

    def stats(self) -> dict:
        """The draft's pool: blocks, blocks free, bytes allocated and the store's bytes."""
        used = self.pool.num_blocks - self.pool.num_free
        return {"draft_kv_blocks_total": self.pool.num_blocks,
                "draft_kv_blocks_free": self.pool.num_free,
                "draft_kv_bytes_allocated": used * self.bytes_per_block,
                "draft_kv_pool_bytes": self.store.nbytes, "draft_steps": self.steps}

    def _sequence(self, req: Request) -> DraftSequence:
        s = self.seqs.get(req.request_id)
        if s is None or s.target is not req:
            if s is not None:
                self.release(req.request_id)
            s = self.seqs[req.request_id] = DraftSequence(req)
        return s

    def _allocate(self, s: DraftSequence, tokens: int) -> bool:
        """Blocks for ``s``'s first ``tokens`` tokens; False when the pool has too few."""
        need = -(-tokens // self.block_size) - len(s.block_table)
        if need > self.pool.num_free:
            return False
        if need > 0:
            s.block_table.extend(self.pool.allocate(need))
        return True


def draft_layout(spec: ModelSpec, dtype: torch.dtype, block_size: int) -> KVLayout:
    """The draft's KV layout: full precision in the compute dtype, one block table."""
    fmt = resolve_format(KVFormatSpec(KV_FORMAT_OF_DTYPE[dtype]), spec.head_dim)
    return KVLayout(spec, fmt, dtype, block_size, residual_slots=0)
