"""A draft model in the plan (``kvledger plan --draft-model``): what its weights and KV take
from the target's pool, and what a verify step costs per ``k`` and the acceptance it needs.

Memory, as the engine lays it out (``engine/spec/draft_model.py``): the draft's weights sit
beside the target's, and its paged KV, full precision (bf16 here, the engine's compute
dtype), holds as many blocks as the target's pool, so every block costs the target's bytes
per block plus the draft's. Per context, a request then takes the target's bytes (blocks,
fixed state, residual block: :meth:`kvledger.ledger.planner.FormatPlan.per_request`) plus the
draft's blocks for the same tokens; concurrency is the pool left after both models' weights
over that.

Speed, priced by the ledger's step model (:mod:`kvledger.ledger.step_model`; the device's
assumed factors, or on ``local`` the ``probe --steps`` fit), for ``batch`` sequences at the
first context: a step that drafts ``k`` tokens per sequence (``k`` batched draft decodes)
and verifies them (chunks of ``k + 1`` tokens) against a plain decode step, and the least
acceptance at which it emits tokens as fast
(:func:`kvledger.ledger.speculation.break_even_acceptance`). That is the figure a draft pair
is judged by before any acceptance is measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.errors import InvalidParameterError
from kvledger.ledger import costs, kv, params
from kvledger.ledger.admission import blocks_for_kv_tokens
from kvledger.ledger.hardware import Device
from kvledger.ledger.kv_format import KVFormatSpec
from kvledger.ledger.kv_groups import kv_groups
from kvledger.ledger.local_fits import local_efficiency
from kvledger.ledger.planner import FormatPlan, Plan, PlanOptions
from kvledger.ledger.speculation import VerifyStep, break_even_acceptance
from kvledger.ledger.step_model import DEFAULT_EFFICIENCY, StepTimeModel
from kvledger.spec import ModelSpec

DRAFT_KV = KVFormatSpec("bf16")
"""The draft's KV format: full precision at the engine's compute dtype (bf16 in a plan)."""
GiB = 2**30


@dataclass(frozen=True)
class DraftContextRow:
    """One context: the draft's KV per request and the concurrency with and without it."""

    context: int
    draft_kv_bytes_per_sequence: int
    max_concurrency: int
    max_concurrency_without_draft: int


@dataclass(frozen=True)
class VerifyRow:
    """A step drafting and verifying ``k`` tokens per sequence against a plain step."""

    k: int
    step_s: float
    plain_step_s: float
    step_ratio: float
    break_even_acceptance: float


@dataclass(frozen=True)
class DraftPlan:
    """The draft's part of a plan (see the module docstring)."""

    model: str
    params_total: int
    weights_bytes: int
    kv_bytes_per_token: int
    block_bytes: int
    pool_bytes: int
    pool_blocks: int
    contexts: tuple[DraftContextRow, ...]
    verify_context: int
    verify_batch: int
    verify: tuple[VerifyRow, ...]
    step_model: str


def _weights(spec: ModelSpec, o: PlanOptions) -> int:
    """The draft's weight bytes: its GGUF bytes, else ``--weights-dtype`` or bf16."""
    if o.weights_dtype is None and spec.gguf is not None:
        return spec.gguf.tensor_bytes
    return params.spec_weight_bytes(spec, o.weights_dtype or "bf16")


def draft_plan(target: ModelSpec, draft: ModelSpec, device: Device, o: PlanOptions,
               target_plan: Plan, k: int = 5) -> DraftPlan:
    """The draft ``draft`` for ``target`` on ``device`` (``target_plan``: the target's plan
    under ``o``).

    Raises:
        InvalidParameterError: vocabularies of different sizes, a draft with sliding-window or
            state layers (the engine refuses both), tensor parallelism, ``k`` < 1.
    """
    if draft.vocab_size != target.vocab_size:
        raise InvalidParameterError(
            f"--draft-model {draft.name} has a vocabulary of {draft.vocab_size} tokens, the "
            f"target {target.name} one of {target.vocab_size}: a draft must share it")
    if len(kv_groups(draft)) > 1 or draft.state_layers:
        raise InvalidParameterError(f"--draft-model {draft.name} ({draft.model_type}) has "
                                    "sliding-window or state layers; the engine refuses it")
    if o.tp != 1:
        raise InvalidParameterError("--draft-model with --tensor-parallel-size > 1: the engine "
                                    "refuses speculative decoding with tensor parallelism")
    if k < 1:
        raise InvalidParameterError(f"--num-speculative-tokens must be >= 1, got {k}")
    weights = _weights(draft, o)
    pool = costs.kv_pool_bytes(device.memory_bytes, target_plan.weights_bytes + weights,
                               int(o.reserve_gib * GiB), o.gpu_util)
    draft_block = kv.kv_bytes_per_block(draft, DRAFT_KV, 1, o.block_size)
    fmt = FormatPlan(target, device, o, target_plan.weights_bytes, pool,
                     target_plan.params_active)
    rows = []
    for n, alone in zip(o.contexts, target_plan.contexts):
        draft_seq = blocks_for_kv_tokens(n, o.block_size) * draft_block
        rows.append(DraftContextRow(n, draft_seq, costs.max_concurrency(
            pool, fmt.per_request(o.kv_format, n) + draft_seq), alone.max_concurrency))
    model_t, model_d, source = _step_models(target, draft, device, o)
    context, batch = o.contexts[0], o.batch
    verify = []
    for j in range(1, k + 1):
        step = VerifyStep(model_t, [], [], [context] * batch, batch, model_d)
        ratio = step([j] * batch) / step([0] * batch)
        verify.append(VerifyRow(j, step([j] * batch), step([0] * batch), ratio,
                                break_even_acceptance(ratio, j)))
    return DraftPlan(
        model=draft.name, params_total=params.count_params(draft).total, weights_bytes=weights,
        kv_bytes_per_token=kv.kv_bytes_per_token(draft, DRAFT_KV, 1, o.block_size),
        block_bytes=target_plan.block_bytes + draft_block, pool_bytes=max(pool, 0),
        pool_blocks=costs.blocks_for(pool, target_plan.block_bytes + draft_block),
        contexts=tuple(rows), verify_context=context, verify_batch=batch,
        verify=tuple(verify), step_model=source)


def _step_models(target: ModelSpec, draft: ModelSpec, device: Device,
                 o: PlanOptions) -> tuple[StepTimeModel, StepTimeModel, str]:
    """(target's, draft's step model, where the factors come from)."""
    eff = DEFAULT_EFFICIENCY
    if device.name == "local":
        eff, _ = local_efficiency(device, o.retention)
    return (StepTimeModel(target, device, eff, o.kv, o.weights_dtype, block_size=o.block_size),
            StepTimeModel(draft, device, eff, DRAFT_KV, o.weights_dtype,
                          block_size=o.block_size), eff.source)
