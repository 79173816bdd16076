"""Compute, bandwidth and capacity bills: prefill FLOPs, TTFT, TPOT floor, pool, concurrency.

Formulas (seed §3.2-§3.4, §5.2):

  prefill FLOPs   ``2 x active params x T`` (one multiply-add per weight per token) plus causal
                  attention: per layer ``2 x heads x (d_qk + d_v) x pairs``, where ``pairs`` is
                  the number of (query, key) pairs a causal mask keeps: ``T(T+1)/2``, or with a
                  window ``W`` each query sees ``min(i, W)`` keys. MLA attends in the
                  uncompressed space (``d_qk = nope + rope``, ``d_v = v_head_dim``); linear
                  attention has no quadratic term (its projections are in the params).
  TTFT estimate   ``FLOPs / (tp x peak FLOP/s x MFU)``; its floor uses MFU = 1.
  TPOT floor      ``(weight bytes read + KV bytes read by the batch) / bandwidth``: decode is
                  memory-bound, each step reads the weights once and every sequence's KV.
  KV pool         ``memory x utilization - weights - activation reserve``; blocks =
                  ``floor(pool / block bytes)`` (vLLM's "# GPU blocks").
  concurrency     ``floor(pool / per-request bytes)``, per-request KV rounded up to whole blocks;
                  with a shared prefix of ``P`` tokens its full blocks are stored once (seed
                  §4.3): ``floor((pool - shared) / (per-request - shared))``.

All byte figures are per tensor-parallel rank. No torch here.
"""

from __future__ import annotations

from kvledger.errors import InvalidParameterError
from kvledger.ledger.admission import blocks_for_kv_tokens
from kvledger.spec import FULL, MLA, SLIDING, ModelSpec


def causal_pairs(tokens: int, window: int | None = None) -> int:
    """(query, key) pairs a causal mask keeps over ``tokens`` positions, optionally windowed."""
    if window is None or window >= tokens:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


def attention_flops(spec: ModelSpec, tokens: int) -> int:
    """FLOPs of the score (QK^T) and mix (PV) matmuls of a causal prefill of ``tokens``."""
    total = 0
    for kind in spec.layers.types:
        if kind == MLA:
            mla = spec.latent
            dims = mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim
        elif kind in (FULL, SLIDING):
            dims = 2 * spec.head_dim
        else:
            continue
        window = spec.layers.sliding_window if kind == SLIDING else None
        total += 2 * spec.num_attention_heads * dims * causal_pairs(tokens, window)
    return total


def prefill_flops(spec: ModelSpec, tokens: int, params_active: int) -> int:
    """FLOPs of prefilling ``tokens`` prompt tokens: ``2 x params_active x T`` + attention."""
    return 2 * params_active * tokens + attention_flops(spec, tokens)


def ttft_s(flops: float, peak_flops_per_s: float, mfu: float = 0.4, tp: int = 1) -> float:
    """Seconds to prefill ``flops`` on ``tp`` devices at ``mfu`` of their peak (TTFT estimate).

    Raises:
        InvalidParameterError: ``mfu`` outside (0, 1].
    """
    if not 0.0 < mfu <= 1.0:
        raise InvalidParameterError(f"--mfu must be in (0, 1], got {mfu}")
    return flops / (tp * peak_flops_per_s * mfu)


def tpot_floor_s(
    weight_bytes_read: float, kv_bytes_read: float, bandwidth_bytes_per_s: float
) -> float:
    """Lower bound of one decode step: bytes it must read over the memory bandwidth (seconds)."""
    return (weight_bytes_read + kv_bytes_read) / bandwidth_bytes_per_s


def kv_pool_bytes(
    memory_bytes: int, weight_bytes: int, reserve_bytes: int, utilization: float = 0.9
) -> int:
    """Bytes left for the KV pool: ``memory x utilization - weights - reserve`` (may be < 0).

    Raises:
        InvalidParameterError: ``utilization`` outside (0, 1] or a negative reserve.
    """
    if not 0.0 < utilization <= 1.0:
        raise InvalidParameterError(f"--gpu-util must be in (0, 1], got {utilization}")
    if reserve_bytes < 0:
        raise InvalidParameterError("--reserve-gib must be >= 0")
    return int(memory_bytes * utilization) - weight_bytes - reserve_bytes


def blocks_for(pool_bytes: int, block_bytes: int) -> int:
    """Whole paged-KV blocks a pool of ``pool_bytes`` holds (0 when the pool is empty)."""
    return max(pool_bytes, 0) // block_bytes


def concurrency_ratio(pool_blocks: int, tokens: int, block_size: int) -> float:
    """How many ``tokens``-long requests the pool holds at once, as vLLM logs it ("1.56x"):
    pool blocks / blocks per request."""
    return pool_blocks / blocks_for_kv_tokens(tokens, block_size)


def max_concurrency(pool_bytes: int, per_request_bytes: int, shared_bytes: int = 0) -> int:
    """Requests that fit at once: ``floor((pool - shared) / (per_request - shared))``.

    Args:
        pool_bytes: bytes of the KV pool (per rank).
        per_request_bytes: KV + fixed state of one request, block-rounded.
        shared_bytes: bytes of a shared prefix every request reuses (stored once).
    """
    unique = per_request_bytes - shared_bytes
    assert unique > 0, "a shared prefix must be shorter than the request"
    if pool_bytes < per_request_bytes:
        return 0
    return (pool_bytes - shared_bytes) // unique
