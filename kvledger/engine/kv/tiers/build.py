"""The KV tiers an ``EngineConfig`` asks for, built for one engine: refusals, fingerprint,
chain and link.

What the tiers do not support yet is refused by name before anything is written: layouts with
more than one layer group or sliding-window layers (Gemma 2/3, Phi-3 with a sliding window:
a sliding layer's blocks are not the full prefix's), MLA (its latent blocks are untested
there), tensor parallelism (the blocks are spread
over ranks), no KV cache, and no prefix caching (blocks are found by their prefix hash).
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from pathlib import Path

from kvledger.engine.kv.events.recorder import CacheEvents
from kvledger.engine.kv.pool import BlockPool
from kvledger.engine.kv.prefix import PrefixCache
from kvledger.engine.kv.tiers.chain import TierChain
from kvledger.engine.kv.tiers.disk import DiskTier
from kvledger.engine.kv.tiers.fingerprint import fingerprint, tensors_digest, weights_digest
from kvledger.engine.kv.tiers.link import LoadPolicy, TierLink
from kvledger.engine.kv.tiers.payload import block_bytes, payload_sizes
from kvledger.engine.kv.tiers.ram import RAMTier
from kvledger.engine.kv.tiers.tier_dir import TierDir
from kvledger.errors import InvalidParameterError
from kvledger.ledger.params import count_params
from kvledger.ledger.tier_load import saved_figures
from kvledger.spec import MLA, SLIDING, ModelSpec

log = logging.getLogger("kvledger.kv_tier")
DEFAULT_DISK_GIB = 10.0
GIB = 1 << 30


def wanted(config) -> bool:
    """True when the config asks for a KV tier."""
    return config.kv_disk_dir is not None or config.kv_ram_gib is not None


def weights_id_of(config, weights: dict | None) -> str:
    """Content digest of the engine's weights: of ``weights`` when the engine was handed
    them, else of ``config.model``'s files (cached by path, size and mtime), or the name of
    seeded dummy weights."""
    from kvledger.paths import cache_dir, resolve_model_path

    if weights is not None:
        return tensors_digest(weights)
    if config.load_format == "dummy":
        return f"dummy:{config.model}"
    return weights_digest(resolve_model_path(config.model), cache_dir() / "weights-digests.json")


def refuse_unsupported(config, spec: ModelSpec) -> None:
    """Raises InvalidParameterError naming what the KV tiers do not support (module
    docstring); nothing when no tier is asked for."""
    if not wanted(config):
        return
    kinds = sorted(set(spec.layers.types))
    if MLA in kinds:
        raise InvalidParameterError(
            f"the KV tiers (--kv-disk-dir, --kv-ram-gib) do not support MLA (multi-head latent "
            f"attention, {spec.model_type}) yet")
    if len(kinds) > 1 or SLIDING in kinds or spec.layers.sliding_window:
        layout = ", ".join(f"{spec.layers.types.count(k)} {k}" for k in kinds)
        raise InvalidParameterError(
            f"the KV tiers (--kv-disk-dir, --kv-ram-gib) do not support {spec.model_type}'s "
            f"layout yet ({layout} layers, sliding window {spec.layers.sliding_window}): only one "
            "layer group of full-attention layers")
    for bad, what in ((config.tensor_parallel_size > 1, "tensor parallelism"),
                      (not config.use_kv_cache, "--no-kv-cache"),
                      (not config.enable_prefix_caching, "--no-prefix-caching")):
        if bad:
            raise InvalidParameterError(f"the KV tiers (--kv-disk-dir, --kv-ram-gib) do not "
                                        f"run with {what}")


def tier_linker(config, tier_dir: TierDir | None, *, weights_id: str, spec: ModelSpec,
                weight_formats: dict, fmt_json: str, outliers, bytes_per_block: int, store,
                policy: LoadPolicy | None = None, events: Callable[[str], CacheEvents] | None = None
                ) -> Callable[[BlockPool, PrefixCache], TierLink]:
    """The tiers of ``config`` (RAM, then disk in ``tier_dir``), and what joins them to the
    engine's pool and prefix cache (``KVCacheManager``'s ``link_tiers``); ``events`` gives a
    tier's KV events hook by its name (None: none)."""
    size = block_bytes(store)
    assert size == bytes_per_block, f"block of {size} bytes != ledger's {bytes_per_block}"
    fp = fingerprint(weights=weights_id, dtype=config.dtype, weight_formats=weight_formats,
                     device="cpu", spec=spec, kv_format_json=fmt_json, outliers=outliers,
                     block_size=config.block_size, tp_size=config.tensor_parallel_size,
                     tp_rank=0)
    tiers = []
    if config.kv_ram_gib is not None:
        tiers.append(RAMTier(int(config.kv_ram_gib * GIB), events and events("ram")))
    if tier_dir is not None:
        gib = config.kv_disk_gib if config.kv_disk_gib is not None else DEFAULT_DISK_GIB
        tiers.append(DiskTier(Path(tier_dir.path), fp, int(gib * GIB), payload_sizes(store),
                              events and events("disk")))
    chain = TierChain(tiers)
    atexit.register(chain.close)
    if policy is None and tier_dir is not None:
        from kvledger.paths import config_dir

        saved = saved_figures(tier_dir.path, config_dir())
        policy = LoadPolicy(saved.cold, saved.warm, saved.prefill_flops_per_s, spec,
                            count_params(spec).active)
    policy = policy or LoadPolicy()
    log.info("KV tiers: %s (fingerprint %s)", ", ".join(
        f"{t.name} {t.stats.capacity_bytes / GIB:g} GiB" for t in tiers), fp[:16])

    def link(pool: BlockPool, prefix: PrefixCache) -> TierLink:
        return TierLink(chain, pool, prefix, store, config.block_size, policy,
                        config.max_num_batched_tokens)

    return link
