"""The plan: every figure ``kvledger plan`` prints, as data.

:func:`plan` answers the seed's questions for one model on one device (seed §5.2's cost
template, extended): KV per token per layer kind; KV at each context next to the weights; chat
growth by turn (§2.3); concurrency per context (§3.4); TTFT and TPOT floor (§3.2-§3.3); the same
for the other KV formats (§4.2); with a disk read speed, where loading a prefix from the disk KV
tier beats recomputing it (:mod:`kvledger.ledger.tier_load`). :meth:`Plan.to_json` is the
``--json`` contract. No torch here.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

from kvledger.errors import InvalidParameterError
from kvledger.ledger import costs, kv, params
from kvledger.ledger.admission import RequestBudget
from kvledger.ledger.hardware import Device, GiB
from kvledger.ledger.kv_format import KV_FORMATS, KVFormatSpec
from kvledger.ledger.kv_groups import kv_groups
from kvledger.ledger.retention import RetentionSpec
from kvledger.ledger.tier_load import Crossover, ReadSpeed, crossover
from kvledger.spec import SLIDING, ModelSpec

DEFAULT_CONTEXTS = (2048, 8192, 32768, 131072)
RESIDUAL_FORMAT = "bf16"  # the activation dtype a quantized-KV engine keeps partial blocks in
# Sequence figures that are not whole blocks (KV / request, TPOT, chat turns) spread a block's
# metadata per token over 16-token blocks, whatever --block-size (as they always have).
PER_TOKEN_BLOCK_SIZE = 16


def parse_contexts(text: str) -> tuple[int, ...]:
    """``"2048,8k,128K"`` -> ``(2048, 8192, 131072)``.

    Raises:
        InvalidParameterError: a part is not an integer (optionally with a k suffix).
    """
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = 1024 if part.endswith("k") else 1
        try:
            out.append(int(part.removesuffix("k")) * scale)
        except ValueError:
            raise InvalidParameterError(
                f"--context takes comma-separated token counts (e.g. 2048,8k,32k), got {text!r}"
            ) from None
    return tuple(out)


@dataclass(frozen=True)
class PlanOptions:
    """What to plan for (CLI flags of the same names). Bytes are per tensor-parallel rank.

    ``weights_dtype`` None means the checkpoint's real bytes for a GGUF, fp8 for an fp8
    checkpoint, else bf16. ``window_aware`` False sizes sliding layers as full attention.
    ``disk_read_gbps`` (GB/s) and ``disk_file_s`` (seconds per block file): the disk KV tier's
    read speed, for the load-or-recompute crossover (None: not planned).
    """

    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    kv_format: str = "bf16"
    weights_dtype: str | None = None
    tp: int = 1
    batch: int = 1
    reserve_gib: float = 2.0
    gpu_util: float = 0.9
    block_size: int = 16
    window_aware: bool = True
    kv_group_size: int | None = None
    kv_outlier_frac: float = 0.0
    kv_outlier_channels: int | None = None
    kv_key_quant: str = "per-channel"
    kv_key_group_tokens: int | None = None
    kv_residual_tokens: int | None = None
    kv_intact_tokens: int | None = None
    shared_prefix: int = 0
    turn_tokens: int = 1024
    turns: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    mfu: float = 0.4
    retention: RetentionSpec = field(default_factory=RetentionSpec)
    disk_read_gbps: float | None = None
    disk_file_s: float = 0.0

    @property
    def kv(self) -> KVFormatSpec:
        """The KV format of the kv_* options."""
        return KVFormatSpec.from_options(self.kv_format, RESIDUAL_FORMAT, self.kv_group_size,
                                         self.kv_key_quant, self.kv_outlier_channels,
                                         self.kv_outlier_frac, self.kv_residual_tokens,
                                         key_group_tokens=self.kv_key_group_tokens,
                                         intact_tokens=self.kv_intact_tokens)


@dataclass(frozen=True)
class LayerKindRow:
    """KV one token stores in the layers of one kind (``window`` for sliding layers)."""

    kind: str
    layers: int
    bytes_per_token_per_layer: int
    bytes_per_token: int
    window: int | None


@dataclass(frozen=True)
class ContextRow:
    """Figures for one context length (one request of ``context`` tokens; batch for TPOT)."""

    context: int
    kv_bytes_per_sequence: int
    kv_bytes_full_reservation: int
    fixed_state_bytes: int
    kv_bytes_batch: int
    max_concurrency: int
    concurrency_ratio: float
    shared_prefix_concurrency: int | None
    prefill_flops: int
    ttft_s: float
    ttft_floor_s: float
    tpot_floor_s: float


@dataclass(frozen=True)
class RetentionRow:
    """One request of ``context`` tokens (prompt = context - 1) under the plan's retention
    policy, in paged blocks as the engine admits it (``RequestBudget.kv_blocks_of``)."""

    context: int
    kv_tokens: int
    kv_blocks: int
    kv_bytes: int
    max_concurrency: int
    full_kv_blocks: int
    full_max_concurrency: int


@dataclass(frozen=True)
class FormatRow:
    """What-if: the same plan with another KV format."""

    kv_format: str
    kv_bytes_per_token: int
    kv_bytes_per_sequence: tuple[int, ...]
    max_concurrency: tuple[int, ...]
    tpot_floor_s: tuple[float, ...]


@dataclass(frozen=True)
class Plan:
    """The full plan (see :func:`plan`).

    ``max_request_tokens`` is the longest request (prompt + output tokens) the pool holds with
    nothing else running, at most the model's context (the admission rule,
    :class:`kvledger.ledger.admission.RequestBudget`). ``turns`` (turn, tokens, KV bytes) stop
    at the model's context; ``context_full_turn`` is the turn that fills it.
    ``tier_crossover``: from how many tokens loading a prefix from the disk tier at
    ``disk_read_gbps`` beats prefilling it at ``tp x peak x mfu`` (None without a disk speed).
    """

    model: str
    model_type: str
    source: str
    device: Device
    options: PlanOptions
    params_total: int
    params_active: int
    weights_dtype: str
    weights_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_sequence: int
    layer_kinds: tuple[LayerKindRow, ...]
    block_bytes: int
    pool_bytes: int
    pool_blocks: int
    max_request_tokens: int
    contexts: tuple[ContextRow, ...]
    turns: tuple[tuple[int, int, int], ...]
    context_full_turn: int
    formats: tuple[FormatRow, ...]
    warnings: tuple[str, ...] = field(default=())
    retention: tuple[RetentionRow, ...] = field(default=())
    tier_crossover: Crossover | None = None

    def to_json(self) -> dict:
        """The ``--json`` contract (plus extra fields)."""
        out = asdict(self)
        out["device"] = asdict(self.device)
        out["turns"] = [{"turn": t, "tokens": n, "kv_bytes": b} for t, n, b in self.turns]
        return out


def _validate(spec: ModelSpec, o: PlanOptions) -> None:
    if not o.contexts:
        raise InvalidParameterError("--context needs at least one length")
    for n in o.contexts:
        if n <= 0:
            raise InvalidParameterError(f"--context must be positive, got {n}")
    if o.batch <= 0:
        raise InvalidParameterError(f"--batch must be positive, got {o.batch}")
    if o.shared_prefix < 0 or o.shared_prefix >= min(o.contexts):
        raise InvalidParameterError(
            f"--shared-prefix must be in [0, {min(o.contexts)}) (shorter than every context)"
        )
    kv.kv_heads_per_rank(spec, o.tp)
    o.kv  # noqa: B018 - validates the KV format's name and options


def _weights(spec: ModelSpec, o: PlanOptions) -> tuple[str, int]:
    """(dtype label, weight bytes per rank)."""
    if o.weights_dtype is None and spec.gguf is not None:
        return "gguf", math.ceil(spec.gguf.tensor_bytes / o.tp)
    dtype = o.weights_dtype or ("fp8" if spec.weights_dtype == "fp8" else "bf16")
    return dtype, math.ceil(params.spec_weight_bytes(spec, dtype) / o.tp)


def plan(spec: ModelSpec, device: Device, options: PlanOptions | None = None) -> Plan:
    """Plan ``spec`` on ``device``.

    Raises:
        InvalidParameterError: a context <= 0, a ``tp`` that does not divide the heads, an
            unknown KV or weights format, a shared prefix not shorter than every context.
    Warnings (in ``Plan.warnings``): contexts beyond ``max_position_embeddings``, weights that
    leave no room for KV, a context whose one request does not fit the pool.
    """
    o = options or PlanOptions()
    _validate(spec, o)
    warnings = [
        f"context {n} is beyond the model's max_position_embeddings "
        f"({spec.max_position_embeddings}); quality is not guaranteed there"
        for n in o.contexts
        if n > spec.max_position_embeddings
    ]
    count = params.count_params(spec)
    dtype, weights = _weights(spec, o)
    pool = costs.kv_pool_bytes(device.memory_bytes, weights, int(o.reserve_gib * GiB), o.gpu_util)
    if pool <= 0:
        warnings.append(
            f"the weights ({weights / GiB:.2f} GiB per rank) and reserve leave no room for KV "
            f"on {device.name}: try --tensor-parallel-size, a smaller --weights-dtype or a bigger device"
        )
    fmt = FormatPlan(spec, device, o, weights, pool, count.active)
    block_bytes = fmt.block_bytes(o.kv_format)
    pool_blocks = costs.blocks_for(pool, block_bytes)
    contexts = tuple(fmt.context_row(n) for n in o.contexts)
    warnings += [
        f"context {r.context}: one request's KV ({r.kv_bytes_full_reservation / GiB:.2f} GiB) "
        f"is more than the KV pool ({max(pool, 0) / GiB:.2f} GiB), so not even one fits "
        "(concurrency 0)"
        for r in contexts
        if r.max_concurrency == 0 and pool > 0
    ]
    return Plan(
        model=spec.name,
        model_type=spec.model_type,
        source=spec.source,
        device=device,
        options=o,
        params_total=count.total,
        params_active=count.active,
        weights_dtype=dtype,
        weights_bytes=weights,
        kv_bytes_per_token=fmt.per_token(o.kv_format),
        state_bytes_per_sequence=fmt.fixed,
        layer_kinds=_layer_kind_rows(spec, o),
        block_bytes=block_bytes,
        pool_bytes=max(pool, 0),
        pool_blocks=pool_blocks,
        max_request_tokens=RequestBudget(
            o.block_size, pool_blocks, spec.max_position_embeddings).max_total_tokens,
        contexts=contexts,
        turns=tuple(
            (t, t * o.turn_tokens, fmt.sequence_bytes(o.kv_format, t * o.turn_tokens))
            for t in o.turns
            if t * o.turn_tokens <= spec.max_position_embeddings
        ),
        context_full_turn=-(-spec.max_position_embeddings // o.turn_tokens),
        formats=tuple(fmt.format_row(f) for f in KV_FORMATS),
        warnings=tuple(warnings),
        retention=_retention_rows(spec, o, pool_blocks, block_bytes),
        tier_crossover=None if o.disk_read_gbps is None else crossover(
            spec, count.active, block_bytes, o.block_size,
            ReadSpeed(o.disk_read_gbps * 1e9, o.disk_file_s),
            o.tp * device.flops_per_s * o.mfu, spec.max_position_embeddings),
    )


def _retention_rows(spec: ModelSpec, o: PlanOptions, pool_blocks: int,
                    block_bytes: int) -> tuple[RetentionRow, ...]:
    """Bounded KV and the concurrency it buys, per context (none under full retention)."""
    r = o.retention
    if not r.evicts:
        return ()
    budget = RequestBudget(o.block_size, pool_blocks, spec.max_position_embeddings)
    rows = []
    for n in o.contexts:
        blocks, full = budget.kv_blocks_of(n, r, n - 1), budget.kv_blocks_of(n)
        rows.append(RetentionRow(
            context=n, kv_tokens=r.max_kv_tokens(n - 1, n), kv_blocks=blocks,
            kv_bytes=blocks * block_bytes, max_concurrency=pool_blocks // max(blocks, 1),
            full_kv_blocks=full, full_max_concurrency=pool_blocks // max(full, 1)))
    return tuple(rows)


def _engine_kv(spec: ModelSpec, o: PlanOptions) -> KVFormatSpec:
    """The plan's KV options as the engine resolves them: with sliding layers beside full ones
    (several block groups) the defaults keep each block whole (keys over one block, no
    intact tokens; ``KVFormatSpec.blockwise_defaults``)."""
    return o.kv.blockwise_defaults(o.block_size) if len(kv_groups(spec)) > 1 else o.kv


def _layer_kind_rows(spec: ModelSpec, o: PlanOptions) -> tuple[LayerKindRow, ...]:
    rows = []
    fmt = _engine_kv(spec, o).as_format(o.kv_format)
    for kind, layers in Counter(spec.layers.types).items():
        per_layer = kv.layer_bytes_per_token(spec, fmt, o.tp, o.block_size, kind)
        window = spec.layers.sliding_window if kind == SLIDING else None
        rows.append(LayerKindRow(kind, layers, per_layer, per_layer * layers, window))
    return tuple(rows)


class FormatPlan:
    """Per-format figures for one (spec, device, options); shared by the main rows and the
    what-if rows so both use one formula."""

    def __init__(self, spec, device, o: PlanOptions, weights: int, pool: int, active: int):
        self.spec, self.device, self.o, self.pool, self.active = spec, device, o, pool, active
        read_ratio = params.params_read_per_step(spec, o.batch) / params.count_params(spec).total
        self.weights_read = weights * read_ratio
        self.fixed = kv.fixed_state_bytes(spec, tp=o.tp)
        self.kv = _engine_kv(spec, o)

    def _spec(self, fmt: str) -> KVFormatSpec:
        """The plan's KV options under format ``fmt`` (outliers on quantized formats only)."""
        return self.kv.as_format(fmt)

    def per_token(self, fmt: str) -> int:
        return kv.kv_bytes_per_token(self.spec, self._spec(fmt), self.o.tp, self.o.block_size)

    def block_bytes(self, fmt: str) -> int:
        return kv.kv_bytes_per_block(self.spec, self._spec(fmt), self.o.tp, self.o.block_size)

    def sequence_bytes(
        self, fmt: str, tokens: int, window_aware: bool | None = None, paged: bool = False
    ) -> int:
        aware = self.o.window_aware if window_aware is None else window_aware
        block_size = self.o.block_size if paged else PER_TOKEN_BLOCK_SIZE
        return kv.kv_bytes_per_sequence(self.spec, self._spec(fmt), self.o.tp, block_size,
                                        tokens, aware, paged)

    def per_request(self, fmt: str, tokens: int) -> int:
        """Whole blocks + fixed state + a quantized format's bf16 residual block (the running
        sequence's partial block, kept at full precision)."""
        o = self.o
        residual = kv.residual_bytes(self.spec, self._spec(fmt), o.tp, o.block_size,
                                     RESIDUAL_FORMAT)
        return self.sequence_bytes(fmt, tokens, paged=True) + self.fixed + residual

    def _shared(self, fmt: str) -> int:
        """Bytes of the shared prefix's full blocks in the layers that keep every token."""
        o = self.o
        full_blocks = o.shared_prefix // o.block_size * o.block_size
        kinds = [k for k in self.spec.layers.types if not (o.window_aware and k == SLIDING)]
        return full_blocks * sum(
            kv.layer_bytes_per_token(self.spec, self._spec(fmt), o.tp, o.block_size, k)
            for k in kinds
        )

    def concurrency(self, fmt: str, tokens: int) -> int:
        return costs.max_concurrency(self.pool, self.per_request(fmt, tokens))

    def tpot(self, fmt: str, tokens: int) -> float:
        kv_read = self.o.batch * (self.sequence_bytes(fmt, tokens, window_aware=True) + self.fixed)
        return costs.tpot_floor_s(self.weights_read, kv_read, self.device.bandwidth_bytes_per_s)

    def context_row(self, n: int) -> ContextRow:
        o, fmt = self.o, self.o.kv_format
        flops = costs.prefill_flops(self.spec, n, self.active)
        peak = self.device.flops_per_s
        shared = None
        if o.shared_prefix:
            shared = costs.max_concurrency(self.pool, self.per_request(fmt, n), self._shared(fmt))
        pool_blocks = costs.blocks_for(self.pool, self.block_bytes(fmt))
        return ContextRow(
            context=n,
            kv_bytes_per_sequence=self.sequence_bytes(fmt, n),
            kv_bytes_full_reservation=self.sequence_bytes(fmt, n, window_aware=False),
            fixed_state_bytes=self.fixed,
            kv_bytes_batch=o.batch * (self.sequence_bytes(fmt, n) + self.fixed),
            max_concurrency=self.concurrency(fmt, n),
            concurrency_ratio=round(costs.concurrency_ratio(pool_blocks, n, o.block_size), 2),
            shared_prefix_concurrency=shared,
            prefill_flops=flops,
            ttft_s=costs.ttft_s(flops, peak, o.mfu, o.tp),
            ttft_floor_s=costs.ttft_s(flops, peak, 1.0, o.tp),
            tpot_floor_s=self.tpot(fmt, n),
        )

    def format_row(self, fmt: str) -> FormatRow:
        ns = self.o.contexts
        return FormatRow(
            kv_format=fmt,
            kv_bytes_per_token=self.per_token(fmt),
            kv_bytes_per_sequence=tuple(self.sequence_bytes(fmt, n) for n in ns),
            max_concurrency=tuple(self.concurrency(fmt, n) for n in ns),
            tpot_floor_s=tuple(self.tpot(fmt, n) for n in ns),
        )
