"""The fleet plan behind ``kvledger plan --replicas`` / ``--target-rps``: replicas of one size
behind a router, on a multi-tenant shared-prefix mix, priced from one replica's capacity,
concurrency and step prices. No torch here.

The mix: ``prefixes`` shared prefixes (system prompts) of ``prefix_tokens`` each, equally
popular, each request adding ``unique_tokens`` of its own and generating ``output_tokens``.

**Hit rate.** A replica's KV pool keeps ``room`` blocks for cached prefixes: the pool less the
blocks of its ``concurrency`` running requests' own tokens. A replica that sees ``k`` prefixes
needs ``k x prefix blocks``; under LRU with equally popular prefixes the fraction of them still
cached when a request comes is ``min(1, room / (k x prefix blocks))``. Each prefix misses once
per replica that sees it (cold), out of ``requests`` in the run (0: steady state). Round robin
shows every replica every prefix (``k = prefixes``); prefix-aware routing (``kv_aware``,
``cache_aware``, llm-d's precise prefix scorer) sends a prefix to one replica
(``k = ceil(prefixes / replicas)``), at the price of imbalance when the prefixes do not split
evenly (the busiest replica carries ``ceil(prefixes / replicas)`` of them). The hit rate is the
fraction of prompt tokens served from cache: whole blocks of the prefix only.

**Service.** A request costs its replica ``uncached prompt tokens x prefill_token_s``, its own
``request_s`` and, for each output token, a share of a decode step: ``step_s / concurrency +
decode_seq_s``; the
replica serves ``1 / service`` requests per second when saturated, the fleet ``replicas``
times that, less the imbalance.

**TTFT.** A request's own prefill plus one step, after a wait priced as an M/M/1 queue over the
replica's busy time per request (utilisation ``rho``): the wait's quantile ``q`` is
``max(0, ln(rho / (1 - q))) x service / (1 - rho)``. A rough queue, stated as such: the engine
interleaves prefills with decodes, so it overstates the wait of a lightly loaded replica.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvledger.errors import InvalidParameterError

ROUTINGS = ("round_robin", "prefix_aware")


@dataclass(frozen=True)
class SharedPrefixMix:
    """The workload (module docstring); ``requests`` 0 = steady state."""

    prefixes: int = 8
    prefix_tokens: int = 1000
    unique_tokens: int = 100
    output_tokens: int = 32
    requests: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < (0 if name == "requests" else 1):
                raise InvalidParameterError(f"--{name.replace('_', '-')} must be positive, "
                                            f"got {value}")

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + self.unique_tokens


@dataclass(frozen=True)
class ReplicaSize:
    """One replica: its pool, block size and the most requests it runs at once."""

    pool_blocks: int
    block_size: int
    max_num_seqs: int

    def own_blocks(self, mix: SharedPrefixMix) -> int:
        """Blocks of one running request's own tokens (its prefix blocks are shared)."""
        own = mix.prompt_tokens + mix.output_tokens - self.prefix_blocks(mix) * self.block_size
        return -(-own // self.block_size)

    def prefix_blocks(self, mix: SharedPrefixMix) -> int:
        return mix.prefix_tokens // self.block_size

    def concurrency(self, mix: SharedPrefixMix) -> int:
        """Requests running at once: ``max_num_seqs``, or fewer when the pool runs out."""
        fit = (self.pool_blocks - self.prefix_blocks(mix)) // max(self.own_blocks(mix), 1)
        return max(0, min(self.max_num_seqs, fit))


@dataclass(frozen=True)
class StepPrices:
    """Seconds: per prefilled token, a decode step's fixed part, per decoding sequence, and
    per request beyond its steps (``request_s``: the serving around them, measured on a replica
    by ``--step-prices``; 0 in the replay's step model)."""

    prefill_token_s: float
    step_s: float
    decode_seq_s: float
    request_s: float = 0.0


@dataclass(frozen=True)
class RoutingRow:
    """One routing's figures; ``ttft_*`` at ``rps`` (None: over capacity or no rate)."""

    routing: str
    prefixes_per_replica: int
    hit_rate: float
    service_s: float
    replica_rps: float
    fleet_rps: float
    rps: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    replicas_needed: int | None


@dataclass(frozen=True)
class FleetPlan:
    """Both routings for one replica size; ``to_json`` is the ``--json`` contract."""

    replicas: int
    replica: ReplicaSize
    concurrency: int
    mix: SharedPrefixMix
    prices: StepPrices
    target_rps: float | None
    ttft_p90_s: float | None
    rows: tuple[RoutingRow, ...]

    def to_json(self) -> dict:
        return asdict(self)


def hit_rate(mix: SharedPrefixMix, replica: ReplicaSize, replicas: int, seen: int) -> float:
    """Fraction of prompt tokens served from cache when each replica sees ``seen`` prefixes."""
    blocks = replica.prefix_blocks(mix)
    if blocks == 0:
        return 0.0
    room = replica.pool_blocks - replica.concurrency(mix) * replica.own_blocks(mix)
    kept = min(1.0, max(room, 0) / (seen * blocks))
    cold = 1.0 if mix.requests == 0 else max(0.0, 1 - seen * replicas / mix.requests)
    return blocks * replica.block_size / mix.prompt_tokens * kept * cold


def _ttft(prefill_s: float, service_s: float, rho: float, q: float) -> float | None:
    if rho >= 1:
        return None
    wait = max(0.0, math.log(rho / (1 - q))) * service_s / (1 - rho) if rho > 0 else 0.0
    return prefill_s + wait


def _row(routing: str, mix: SharedPrefixMix, replica: ReplicaSize, prices: StepPrices,
         replicas: int, rps: float | None, ttft_p90: float | None) -> RoutingRow:
    seen = mix.prefixes if routing == "round_robin" else -(-mix.prefixes // replicas)
    rate = hit_rate(mix, replica, replicas, seen)
    b = replica.concurrency(mix)
    prefill_s = mix.prompt_tokens * (1 - rate) * prices.prefill_token_s + prices.request_s
    service = prefill_s + mix.output_tokens * (prices.step_s / max(b, 1) + prices.decode_seq_s)
    share = 1 / replicas if routing == "round_robin" else seen / mix.prefixes
    fleet = 1 / service / share if b else 0.0
    rho = None if rps is None else rps * share * service
    p50 = None if rho is None else _ttft(prefill_s + prices.step_s, service, rho, 0.5)
    p90 = None if rho is None else _ttft(prefill_s + prices.step_s, service, rho, 0.9)
    needed = None
    if rps is not None and ttft_p90 is not None:
        needed = _needed(lambda n: _row(routing, mix, replica, prices, n, rps, None), ttft_p90)
    return RoutingRow(routing, seen, rate, service, 1 / service if b else 0.0, fleet, rps,
                      p50, p90, needed)


def _needed(row_at, ttft_p90: float, most: int = 4096) -> int | None:
    """The fewest replicas whose TTFT p90 meets ``ttft_p90`` (None: none up to ``most``)."""
    for n in range(1, most + 1):
        p90 = row_at(n).ttft_p90_s
        if p90 is not None and p90 <= ttft_p90:
            return n
    return None


def fleet_plan(mix: SharedPrefixMix, replica: ReplicaSize, prices: StepPrices, replicas: int,
               target_rps: float | None = None, ttft_p90_s: float | None = None) -> FleetPlan:
    """Both routings of ``replicas`` replicas of ``replica``'s size on ``mix``.

    Raises:
        InvalidParameterError: replicas < 1, a rate or TTFT <= 0, a TTFT without a rate, or a
            replica whose pool cannot run one request of the mix.
    """
    if replicas < 1:
        raise InvalidParameterError(f"--replicas must be >= 1, got {replicas}")
    for name, value in (("--target-rps", target_rps), ("--ttft-p90", ttft_p90_s)):
        if value is not None and value <= 0:
            raise InvalidParameterError(f"{name} must be positive, got {value}")
    if ttft_p90_s is not None and target_rps is None:
        raise InvalidParameterError("--ttft-p90 needs --target-rps")
    if replica.concurrency(mix) == 0:
        raise InvalidParameterError(
            f"a replica of {replica.pool_blocks} blocks cannot hold one request of the mix "
            f"({replica.prefix_blocks(mix) + replica.own_blocks(mix)} blocks)")
    rows = tuple(_row(r, mix, replica, prices, replicas, target_rps, ttft_p90_s)
                 for r in ROUTINGS)
    return FleetPlan(replicas, replica, replica.concurrency(mix), mix, prices, target_rps,
                     ttft_p90_s, rows)
