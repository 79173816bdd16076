"""Speculative decoding in the paged engine: proposals verified in the step's one forward.

Each step, after the scheduler planned it (:meth:`Speculator.draft`): every one-token decode
chunk of a request under full retention asks the proposer (a lookup, ``proposer.py``, or the
draft model, ``draft_model.py``, batched over the step's decodes) for up to
``num_speculative_tokens`` tokens, fewer where its ``max_tokens`` ends sooner, where a quantized store would seal a block
holding one (a sealed block is final: the proposal stops before the key group's end, which the
next plain decode seals) or where its grammar refuses one (cut at the first such token). The
gate (``gate.py``) decides how many each verifies (a draft model, which costs a forward per
token, drafts only that many, :meth:`Speculator._draft_rooms`); the scheduler grants the slots within the
step's token budget and the free blocks, never preempting (``Scheduler.extend_chunk``). The
chunk then computes its last token and the proposed ones, a prefill segment after its cached
tokens, beside plain decodes and prefill chunks, with logits at every position.

After the forward (:meth:`Speculator.emit`), position by position: the token emitted there is
the target's (``verify.py``: greedy argmax or rejection sampling), appended as the engine
appends any token (logprobs, grammar, stop strings, EOS, length); the walk stops at the first
rejected proposal (the emitted token replaces it), at the last position (a bonus token) or
when the request finishes. Rolled back exactly: the chunk's computed tokens become the last
token plus the accepted ones before the scheduler advances, so only accepted tokens are ever
hashed into the prefix cache (and written to a KV tier); the blocks past them go back to the
pool (``KVCacheManager.trim``), and rejected slots inside kept blocks are overwritten by the
next step's writes (a quantized store seals none of them, see above). The draft model keeps
the K/V of its accepted proposals and gives back the rest (``DraftModel.keep``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import torch

from kvledger.engine.request import Request
from kvledger.engine.sample.sampler import Sampler, token_logprob
from kvledger.engine.sched.output import ScheduledChunk, SchedulerOutput
from kvledger.engine.sched.scheduler import Scheduler
from kvledger.engine.spec.config import SpeculativeConfig
from kvledger.engine.spec.draft_model import DraftModel
from kvledger.engine.spec.gate import Gate
from kvledger.engine.spec.proposer import Proposer
from kvledger.engine.spec.verify import verify_token

PROBE_STEPS = 8
"""A draft model drafts one token every this many steps for a sequence the gate turns down."""


class Speculator:
    """Proposes, verifies and accounts speculative tokens for one engine.

    Args:
        config: the checked ``speculative_config`` (method other than ``off``).
        scheduler, sampler: the engine's.
        store: the KV store (its ``quantized`` / ``sealed_blocks`` bound the proposals).
        append: the engine's ``_append(req, token, logprob, now)`` -> its RequestOutput.
        gate: the gate (``gate.py``), priced by the ledger's step models.
        drafter: the draft model of method ``draft_model`` (None for the lookups).
    """

    def __init__(self, config: SpeculativeConfig, scheduler: Scheduler, sampler: Sampler,
                 store, append: Callable, gate: Gate, drafter: DraftModel | None = None) -> None:
        self.config, self.scheduler, self.sampler, self.store = config, scheduler, sampler, store
        self.append, self.gate, self.drafter = append, gate, drafter
        self.proposer = Proposer(config)
        self.proposed: Counter[str] = Counter()  # method -> tokens verified
        self.accepted: Counter[str] = Counter()  # method -> tokens accepted
        self._method: dict[int, str] = {}  # id(chunk) -> method, for this step only
        self._declined: dict[int, int] = {}  # id(chunk) -> first token the gate turned down
        self._draft_steps = 0  # steps a draft model was asked to propose in

    # ------------------------------------------------------------------ before the forward

    def draft(self, plan: SchedulerOutput) -> None:
        """Give this step's decode chunks their proposed tokens (see the module docstring)."""
        self._method.clear()
        self._declined.clear()
        found = []
        for c, tokens, method in self._proposals(plan):
            req = c.request
            if req.grammar is not None and tokens:
                tokens = tokens[: req.grammar.validate_tokens(tokens)]
            if tokens:
                found.append((c, tokens, method))
        if not found:
            return
        ks = self.gate.choose(plan, [c for c, _, _ in found],
                              [self.gate.acceptance(c.request, m) for c, _, m in found],
                              [len(t) for _, t, _ in found])
        for (c, tokens, method), k in zip(found, ks):
            self._method[id(c)] = method
            granted = self.scheduler.extend_chunk(plan, c, k) if k else 0
            c.draft = tokens[:granted]
            c.num_new_tokens += granted
            if not granted:
                self._declined[id(c)] = tokens[0]

    def _proposals(self, plan: SchedulerOutput) -> list[tuple[ScheduledChunk, list[int], str]]:
        """(chunk, proposed tokens, method) of every chunk with room for a proposal."""
        rooms = [(c, room) for c in plan.chunks if (room := self._room(c)) > 0]
        if self.drafter is None:
            return [(c, *self.proposer.propose(c.request.all_token_ids, room))
                    for c, room in rooms]
        self.drafter.retain(self.scheduler.running)
        rooms = self._draft_rooms(plan, rooms)
        drafts = self.drafter.propose([c.request for c, _ in rooms], [r for _, r in rooms])
        return [(c, tokens, "draft_model") for (c, _), tokens in zip(rooms, drafts)]

    def _draft_rooms(self, plan: SchedulerOutput, rooms: list) -> list:
        """A draft model costs a forward per proposed token, so it drafts only what the gate
        would verify at each sequence's acceptance (all of ``rooms`` with the gate off); a
        sequence the gate turns down drafts one token every :data:`PROBE_STEPS` steps, which
        the gate declines and compares with the emitted token (its acceptance stays
        measured)."""
        if not self.gate.enabled or not rooms:
            return rooms
        ks = self.gate.choose(plan, [c for c, _ in rooms],
                              [self.gate.acceptance(c.request, "draft_model") for c, _ in rooms],
                              [r for _, r in rooms])
        self._draft_steps += 1
        probe = self._draft_steps % PROBE_STEPS == 0
        return [(c, k or 1) for (c, _), k in zip(rooms, ks) if k or probe]

    def _room(self, c: ScheduledChunk) -> int:
        """Most tokens ``c`` may verify: 0 unless it is a one-token decode of a request under
        full retention; within its ``max_tokens`` (its KV never passes what admission
        allowed) and short of sealing a quantized block."""
        req = c.request
        if not (c.samples and c.num_new_tokens == 1 and req.num_computed_tokens > 0):
            return 0
        if req.retention.spec.evicts:
            return 0
        room = min(self.config.num_speculative_tokens,
                   req.max_tokens_effective - 1 - len(req.output_token_ids))
        if self.store is not None and self.store.quantized and room > 0:
            start = req.num_computed_tokens
            sealed = self.store.sealed_blocks(start + 1)
            while room > 0 and self.store.sealed_blocks(start + 1 + room) != sealed:
                room -= 1
        return room

    # ------------------------------------------------------------------ after the forward

    def emit(self, plan: SchedulerOutput, logits: torch.Tensor) -> list:
        """Sample every sampling chunk's tokens, verify the proposals, advance the scheduler
        and roll back what was rejected; one output per request that progressed."""
        plain, drafted, row = [], [], 0
        for c in plan.chunks:
            if not c.samples:
                continue
            n = 1 + len(c.draft)
            (drafted if c.draft else plain).append((c, logits[row: row + n]))
            row += n
        outputs = [self._verify(c, rows) for c, rows in drafted]
        sampled = ([], [])
        if plain:
            sampled = self.sampler.sample(torch.cat([r for _, r in plain]),
                                          [c.request for c, _ in plain])
        self.scheduler.advance(plan)
        for c, _ in drafted:
            if not c.request.is_finished:
                self.scheduler.kv.trim(c.request)
        now = time.perf_counter()
        for (c, _), token, lp in zip(plain, *sampled):
            if id(c) in self._declined:
                first = self._declined[id(c)]
                self.gate.record(c.request, self._method[id(c)], int(token == first),
                                 token != first)
            outputs.append(self.append(c.request, token, lp, now))
        for out, (c, _) in zip(outputs, drafted + plain):
            if out.finished:
                self.proposer.finished(c.request.prompt_token_ids, c.request.output_token_ids)
            if self.drafter is not None:
                self.drafter.keep(c.request)
        return outputs

    def _verify(self, c: ScheduledChunk, rows: torch.Tensor):
        """Emit ``c``'s tokens position by position (see the module docstring) and set its
        computed tokens to the last one plus the accepted proposals."""
        req, draft = c.request, c.draft
        out = req.output
        text_before, emitted, accepted, rejected = len(out.text), [], 0, False
        for j in range(len(draft) + 1):
            proposal = draft[j] if j < len(draft) else None
            token = verify_token(self.sampler, rows[j: j + 1], req, proposal)
            self.append(req, token, self._logprob(rows[j], token, req), time.perf_counter())
            emitted.append(token)
            if proposal is not None:
                accepted += token == proposal
                rejected = token != proposal
            if req.is_finished or token != proposal:
                break
        c.num_new_tokens -= len(draft) - accepted  # the last token + the accepted ones
        method = self._method[id(c)]
        self.proposed[method] += len(draft)
        self.accepted[method] += accepted
        req.metrics.spec_proposed_tokens += len(draft)
        req.metrics.spec_accepted_tokens += accepted
        self.gate.record(req, method, accepted, rejected)
        out.new_token_ids, out.new_text = emitted, out.text[text_before:]
        return out

    @staticmethod
    def _logprob(row: torch.Tensor, token: int, req: Request):
        k = req.params.logprobs
        return None if k is None else token_logprob(row, token, k)

    def stats(self) -> dict:
        """Cumulative counters: tokens verified and accepted, in all and per method."""
        s = {"spec_proposed_tokens": sum(self.proposed.values()),
             "spec_accepted_tokens": sum(self.accepted.values())}
        for method in sorted(self.proposed):
            s[f"spec_proposed_tokens_{method}"] = self.proposed[method]
            s[f"spec_accepted_tokens_{method}"] = self.accepted[method]
        if self.drafter is not None:
            s.update(self.drafter.stats())
        return s
