"""How long one engine step takes on a device: the ledger's compute and bandwidth terms.

For a step that computes chunks ``(h_c, n_c)`` (``n_c`` new tokens attending ``h_c`` tokens
already cached) the features are

  tokens  ``T = sum n_c``
  pairs   ``P = sum (n_c h_c + n_c (n_c + 1) / 2)``: causal (query, key) pairs attended
  kv_read ``R = sum (h_c + n_c)``: KV tokens each chunk reads (a chunk reads its context
          once, as a paged kernel does)
  seqs    ``S``: chunks (sequences) in the step
  sampled ``N``: chunks that sample a token (those reaching their request's end; a chunk
          inside a long prompt samples nothing)
  decode_groups ``G``: attention calls per layer of the step's decodes (chunks of one token
          after cached ones): the engine attends decodes of near lengths together
          (:func:`length_groups`: a group spans at most 1.25 x its first context),
          one call each; a decode under an evicting policy is a call of its own
  paged_pairs ``P_p``: the pairs of ``P`` in prefill chunks (more than one new token) that
          start after cached tokens (a prefix-cache hit, a chunked prompt's later chunks):
          the engine attends those through the paged kernel, query by query, not through the
          dense causal attention of a chunk from position 0 (full retention only; an
          evicting policy's chunks attend a gathered copy, densely)

The context ``h_c`` is the chunk's start position under full retention; under an evicting
``--kv-policy`` it is the tokens the sequence still holds (:func:`kept_context`: at most the
policy's capacity - 1 for window / sinks / h2o, the compressed prompt plus the output for
snapkv), which is what the engine's slot view gathers and attends.

The ledger's terms on a device of peak ``F`` FLOP/s and ``B`` bytes/s, per tensor-parallel
rank (:mod:`kvledger.ledger.costs`):

  compute_s = (2 x active params x T + attention FLOPs per pair x P) / (tp x F)
  memory_s  = (weight bytes read + KV bytes per token x (R + T)) / B   (per rank)

  collective_s (tp > 1) = 2 x layers x all_reduce(hidden x T x a) + gather(N x ceil(V / tp) x a)
          the two all-reduces of every layer (after the attention output and the MLP down
          projections, whose inputs are split by columns) and the gather of the vocabulary-split
          logits on rank 0, ``a`` bytes per activation (2 for bf16), priced at the link
          bandwidth between ranks (:mod:`kvledger.ledger.interconnect`: ring all-reduce,
          bandwidth only, no latency); this is the engine's tensor parallelism
          (``kvledger/engine/parallel/rank_model.py``)

  duration  = step_overhead_s + seq_overhead_s x S + decode_group_s x G
              + dense_s / mfu + paged_s / paged_mfu + weights_s / weights_mbu + kv_s / mbu
              + collective_s

where ``compute_s = dense_s + paged_s`` splits the FLOPs into those of the matmuls and dense
attention and those of the paged pairs ``P_p``, and ``memory_s = weights_s + kv_s`` into the
weight bytes and the KV bytes. The terms are added, not overlapped (max): an engine that does
not overlap its weight reads with its matmuls (a CPU engine, small batches) pays both. ``mfu``,
``paged_mfu``, ``weights_mbu`` and ``mbu`` are the efficiency factors, the fraction of peak
FLOP/s and bandwidth each part reaches (``paged_mfu`` None: ``mfu``; ``weights_mbu`` None:
``mbu``, as for the devices of the table); the overheads are the framework's fixed cost per
step, per sequence and per decode attention call (scheduling, sampling, launches: ~30 layers
of kernel calls per group).

Factors for the devices of the table are :data:`DEFAULT_EFFICIENCY`: round figures we assume,
not measurements (the planner's MFU of 0.4 for prefill, 0.7 of peak bandwidth for decode, a few
milliseconds of framework time per step). ``kvledger probe --steps`` fits the factors of the
``local`` device from measured steps (:mod:`kvledger.replay.fit`), which shows how far such
round figures are from one real engine (the fit prices the weight reads at the measured
bandwidth, ``weights_mbu`` 1, since a dense model reads the same weights every step and their
share cannot be told from the fixed cost). The engine's evicting policies reach other factors
than full retention over the same tokens (their sequences attend a gathered slot view, h2o
scores every step's attention), so the ``local`` file holds one fit per retention
configuration (:mod:`kvledger.ledger.local_fits`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.errors import InvalidParameterError
from kvledger.ledger.costs import attention_flops
from kvledger.ledger.hardware import Device
from kvledger.ledger.interconnect import all_reduce_s, gather_s, link_bytes_per_s
from kvledger.ledger.kv import kv_bytes_per_token
from kvledger.ledger.kv_format import KVFormatSpec
from kvledger.ledger.params import count_params, params_read_per_step, spec_weight_bytes
from kvledger.ledger.planner import PlanOptions
from kvledger.ledger.retention import RetentionSpec
from kvledger.spec import ModelSpec

BF16 = KVFormatSpec("bf16")


def kept_context(spec: RetentionSpec, start: int, num_prompt_tokens: int) -> int:
    """Tokens before position ``start`` that a sequence under ``spec`` still holds when it
    computes its tokens from ``start`` on (the ``h`` of the module docstring).

    full: ``start``. window / sinks / h2o: ``min(start, capacity - 1)`` (between steps the
    engine keeps ``capacity - 1`` tokens, the next query adding itself). snapkv: ``start``
    while the prompt is prefilled, afterwards the prompt compressed to ``budget`` plus the
    tokens since (``start - max(0, prompt - budget)``); the same for window / sinks / h2o in
    scope ``prompt`` with their ``prompt_keep``.
    """
    if spec.capacity is not None:
        return min(start, spec.capacity - 1)
    if spec.compresses_prompt and start >= num_prompt_tokens:
        return start - max(0, num_prompt_tokens - spec.prompt_keep)
    return start


def _pairs(h: int, n: int) -> int:
    """Causal (query, key) pairs of ``n`` new tokens after ``h`` cached ones."""
    return n * h + n * (n + 1) // 2


MAX_PADDING = 1.25
"""Longest context over the shortest (+1) that one decode group pads to."""


def length_groups(items: list, length, max_padding: float = MAX_PADDING) -> list[list]:
    """Split ``items`` sorted by ``length(item)`` (tokens already computed: a decode's context
    before its new token) into the decode groups the runner attends together, one attention
    call per layer each: a group takes the next item while its length is at most
    ``max_padding`` x (the group's first length + 1), so no group pads past that ratio.
    The engine's runner groups its decodes with it; :class:`StepFeatures` counts them."""
    groups: list[list] = []
    for item in items:
        if groups and length(item) <= max_padding * (length(groups[-1][0]) + 1):
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


@dataclass(frozen=True)
class StepFeatures:
    """What one step computes and reads (see the module docstring)."""

    tokens: int
    pairs: int
    kv_read_tokens: int
    seqs: int
    sampled: int
    decode_groups: int = 0
    paged_pairs: int = 0

    @classmethod
    def of(cls, chunks: list[tuple[int, int]], sampled: int | None = None,
           evicting: bool = False) -> StepFeatures:
        """Features of chunks given as ``(context, num_new_tokens)``, the context being the
        cached tokens the chunk attends (its start under full retention); ``sampled`` chunks
        sample a token (None: all of them); ``evicting``: the chunks' requests run an evicting
        policy (each decode its own attention call, no paged pairs)."""
        plain, kept = ([], chunks) if evicting else (chunks, [])
        return cls.of_parts(plain, kept, len(chunks) if sampled is None else sampled)

    @classmethod
    def of_plan(cls, plan) -> StepFeatures:
        """Features of a scheduler step (the engine's ``SchedulerOutput``, read through its
        chunks only: the ledger imports nothing of the engine), each chunk's context under
        its request's retention policy (:func:`kept_context`)."""
        plain, kept = [], []
        for c in plan.chunks:
            spec = c.request.retention.spec
            h = kept_context(spec, c.start, c.request.num_prompt_tokens)
            (kept if spec.evicts else plain).append((h, c.num_new_tokens))
        return cls.of_parts(plain, kept, sum(1 for c in plan.chunks if c.samples))

    @classmethod
    def of_parts(cls, plain: list[tuple[int, int]], kept: list[tuple[int, int]],
            sampled: int) -> StepFeatures:
        """Features of chunks ``(context, new tokens)`` of requests under full retention
        (``plain``) and under evicting policies (``kept``)."""
        chunks = [*plain, *kept]
        decodes = sorted(h for h, n in plain if n == 1 and h > 0)
        return cls(tokens=sum(n for _, n in chunks),
                   pairs=sum(_pairs(h, n) for h, n in chunks),
                   kv_read_tokens=sum(h + n for h, n in chunks), seqs=len(chunks),
                   sampled=sampled,
                   decode_groups=len(length_groups(decodes, int))
                   + sum(1 for h, n in kept if n == 1 and h > 0),
                   paged_pairs=sum(_pairs(h, n) for h, n in plain if h > 0 and n > 1))


@dataclass(frozen=True)
class Efficiency:
    """Efficiency factors of a device (see the module docstring).

    Attributes:
        mfu: fraction of peak FLOP/s the matmuls and dense attention reach, > 0.
        mbu: fraction of peak memory bandwidth the KV reads and writes reach, > 0.
        step_overhead_s: fixed seconds per step.
        seq_overhead_s: seconds per sequence in the step.
        source: where the figures come from ("assumed defaults", or a fit's description).
        decode_group_s: seconds per decode attention call (group) of a step, >= 0.
        paged_mfu: fraction of peak FLOP/s of the paged pairs (None: ``mfu``), > 0.
        weights_mbu: fraction of peak bandwidth of the weight reads (None: ``mbu``), > 0.
    """

    mfu: float
    mbu: float
    step_overhead_s: float
    seq_overhead_s: float
    source: str
    decode_group_s: float = 0.0
    paged_mfu: float | None = None
    weights_mbu: float | None = None

    def __post_init__(self) -> None:
        if (self.mfu <= 0 or self.mbu <= 0 or self.step_overhead_s < 0
                or self.seq_overhead_s < 0 or self.decode_group_s < 0
                or (self.paged_mfu is not None and self.paged_mfu <= 0)
                or (self.weights_mbu is not None and self.weights_mbu <= 0)):
            raise InvalidParameterError(f"efficiency factors out of range: {self}")

    @property
    def paged_factor(self) -> float:
        """The fraction of peak FLOP/s the paged pairs are priced at."""
        return self.mfu if self.paged_mfu is None else self.paged_mfu

    @property
    def weights_factor(self) -> float:
        """The fraction of peak bandwidth the weight reads are priced at."""
        return self.mbu if self.weights_mbu is None else self.weights_mbu


DEFAULT_EFFICIENCY = Efficiency(mfu=PlanOptions().mfu, mbu=0.7, step_overhead_s=0.003,
                                seq_overhead_s=0.00005,
                                source="assumed defaults (not measured)")


class StepTimeModel:
    """Step durations of ``spec`` on ``device`` (see the module docstring).

    Args:
        spec: the model.
        device: peak FLOP/s and bandwidth.
        efficiency: the factors.
        kv: the KV format the steps read and write.
        weights_dtype: weights format for the bytes read (None: the checkpoint's, or the GGUF
            file's real bytes).
        tp: tensor-parallel ranks.
        activation_bytes: bytes per activation element the collectives move (2: bf16).
        link_gbs: per-direction bandwidth between ranks, GB/s (None: the device's, see
            :mod:`kvledger.ledger.interconnect`).
        block_size: tokens per KV block (a quantized format's metadata per token).

    Raises:
        InvalidParameterError: tp > 1 on a device with no known link and no ``link_gbs``.
    """

    def __init__(self, spec: ModelSpec, device: Device, efficiency: Efficiency,
                 kv: KVFormatSpec = BF16, weights_dtype: str | None = None,
                 tp: int = 1, activation_bytes: int = 2, link_gbs: float | None = None,
                 block_size: int = 16):
        self.spec, self.device, self.eff, self.tp = spec, device, efficiency, tp
        self.activation_bytes = activation_bytes
        self.link = link_bytes_per_s(device, link_gbs) if tp > 1 else None
        counts = count_params(spec)
        self.flops_per_token = 2 * counts.active
        self.flops_per_pair = attention_flops(spec, 1)
        self.weight_bytes = spec_weight_bytes(spec, weights_dtype) / tp
        self.bytes_per_param = self.weight_bytes * tp / counts.total
        self.kv_bytes_per_token = kv_bytes_per_token(spec, kv, tp, block_size)

    def parts(self, f: StepFeatures) -> tuple[float, float, float, float]:
        """(dense compute, paged compute, weight reads, KV reads and writes) of a step, in
        seconds at the device's peaks (see the module docstring)."""
        peak_flops = self.tp * self.device.flops_per_s
        paged = self.flops_per_pair * f.paged_pairs
        flops = self.flops_per_token * f.tokens + self.flops_per_pair * f.pairs - paged
        weights = self.weight_bytes
        if self.spec.is_moe:  # an MoE step reads only the experts its tokens touch
            weights = params_read_per_step(self.spec, max(f.tokens, 1)) * \
                self.bytes_per_param / self.tp
        kv = self.kv_bytes_per_token * (f.kv_read_tokens + f.tokens)
        bandwidth = self.device.bandwidth_bytes_per_s
        return flops / peak_flops, paged / peak_flops, weights / bandwidth, kv / bandwidth

    def terms(self, f: StepFeatures) -> tuple[float, float]:
        """(compute seconds at peak, memory seconds at peak) of a step: the ledger's terms."""
        dense, paged, weights, kv = self.parts(f)
        return dense + paged, weights + kv

    def collective_s(self, f: StepFeatures) -> float:
        """Seconds of the step's tensor-parallel all-reduces and logits gather (0 at tp 1)."""
        if self.tp == 1:
            return 0.0
        s, a = self.spec, self.activation_bytes
        reduce = all_reduce_s(s.hidden_size * f.tokens * a, self.tp, self.link)
        logits = gather_s(f.sampled * -(-s.vocab_size // self.tp) * a, self.tp, self.link)
        return 2 * s.num_layers * reduce + logits

    def duration(self, f: StepFeatures) -> float:
        """Seconds of a step with features ``f``."""
        dense, paged, weights, kv = self.parts(f)
        e = self.eff
        return (e.step_overhead_s + e.seq_overhead_s * f.seqs + e.decode_group_s * f.decode_groups
                + dense / e.mfu + paged / e.paged_factor + weights / e.weights_factor
                + kv / e.mbu + self.collective_s(f))
