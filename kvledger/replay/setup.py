"""From ``kvledger replay`` options to one simulated run: model, device, factors, pool, clock,
sweep.

The factors: :func:`efficiency_for` (on ``local``, the ``probe --steps`` fit of the setting's
retention policy).

The pool: ``--num-blocks`` / ``--kv-cache-gib``, or on ``local`` the engine's own rule
(``kvledger.engine.kv.pool_size.pool_blocks``: what ``kvledger serve`` here would allocate); on a
table device the planner's (device memory x ``gpu_util`` - weights - reserve, per rank, in
blocks of the ledger's bytes). Bytes per block are the ledger's for the KV format.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvledger.engine.config import EngineConfig
from kvledger.engine.kv.pool_size import pool_blocks
from kvledger.errors import InvalidParameterError
from kvledger.ledger.costs import blocks_for, kv_pool_bytes
from kvledger.ledger.hardware import Device, GiB
from kvledger.ledger.interconnect import link_bytes_per_s
from kvledger.ledger.kv import kv_bytes_per_block
from kvledger.ledger.kv_format import KVFormatSpec, kv_format
from kvledger.ledger.local_fits import local_efficiency
from kvledger.ledger.params import spec_weight_bytes
from kvledger.ledger.planner import PlanOptions
from kvledger.ledger.step_model import DEFAULT_EFFICIENCY, Efficiency, StepTimeModel
from kvledger.replay.simulator import ModelClock, RecordedClock, ReplayRun, Simulator
from kvledger.replay.trace import Trace
from kvledger.spec import ModelSpec

SWEEP_KEYS = {  # --sweep key -> (what it sets, value type)
    "max-num-seqs": ("max_num_seqs", int),
    "max-num-batched-tokens": ("max_num_batched_tokens", int),
    "num-blocks": ("num_blocks", int),
    "kv-cache-gib": ("kv_cache_gib", float),
    "block-size": ("block_size", int),
    "max-kv-tokens-per-request": ("max_kv_tokens_per_request", int),
    "long-prompt-tokens": ("long_prompt_tokens", int),
    "kv-cache-dtype": ("kv_cache_dtype", str),
    "kv-policy": ("kv_policy", str),
    "kv-window": ("kv_window", int),
    "kv-budget": ("kv_budget", int),
    "tp": ("tensor_parallel_size", int),
    "speed": ("speed", float),
}


@dataclass
class Setting:
    """One replay setting: engine options plus what only the replay has."""

    config: EngineConfig
    speed: float = 1.0
    label: str = "replay"
    extra: dict = field(default_factory=dict)


def parse_sweep(text: str | None) -> tuple[str, list] | None:
    """``key=v1,v2,...`` -> (key, typed values).

    Raises:
        InvalidParameterError: unknown key (the message lists them) or a bad value.
    """
    if not text:
        return None
    key, _, values = text.partition("=")
    key = key.strip()
    if key not in SWEEP_KEYS or not values:
        raise InvalidParameterError(
            f"--sweep takes KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}; got {text!r}")
    kind = SWEEP_KEYS[key][1]
    try:
        typed = [kind(v.strip()) for v in values.split(",") if v.strip()]
    except ValueError:
        raise InvalidParameterError(f"--sweep {key}: bad value in {values!r}") from None
    return key, typed


def settings(base: Setting, sweep: tuple[str, list] | None) -> list[Setting]:
    """The base setting, or one per swept value (labelled ``key=value``).

    Raises:
        InvalidParameterError: a swept engine value out of range or an unknown KV format
            (from EngineConfig).
    """
    if sweep is None:
        return [base]
    key, values = sweep
    name = SWEEP_KEYS[key][0]
    out = []
    for v in values:
        s = dataclasses.replace(base, label=f"{key}={v}")
        if name == "speed":
            setattr(s, name, v)
        else:
            s.config = dataclasses.replace(base.config, **{name: v})
        out.append(s)
    return out


def recorded_config(header: dict) -> EngineConfig:
    """The recording engine's options from a trace header (its pool as ``num_blocks``).

    Raises:
        InvalidParameterError: the header has no engine options.
    """
    recorded = header.get("engine")
    if not recorded:
        raise InvalidParameterError("the trace header records no engine options (`kvledger "
                                    "serve --trace` records them; a `kvledger bench` trace "
                                    "does not)")
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    config = EngineConfig(**{k: v for k, v in recorded.items() if k in fields})
    if header.get("num_blocks"):
        config = dataclasses.replace(config, num_blocks=header["num_blocks"])
    return config


def check_replayable(config: EngineConfig, device: Device, link_gbs: float | None = None
                     ) -> None:
    """Refuse what the engine would refuse, and a tensor-parallel replay without a link.

    Raises:
        InvalidParameterError: an evicting ``--kv-policy`` over a quantized KV format (the
            engine runs evicting policies on full-precision KV only); under ``--tp`` > 1 a
            ``link_gbs`` <= 0 or a device with no known link.
    """
    if config.tensor_parallel_size > 1:
        link_bytes_per_s(device, link_gbs)
    fmt = kv_format_of(config, device)
    if config.retention.evicts and fmt.quantized:
        raise InvalidParameterError(
            f"--kv-policy {config.retention.policy} runs on full-precision KV (fp32, bf16, "
            f"fp16), not {fmt.name}, in the engine and so in replay")


def live_retention(header: dict):
    """The recording engine's default retention policy (None: the header has no engine)."""
    try:
        return recorded_config(header).retention
    except InvalidParameterError:
        return None


def compute_format_of(config: EngineConfig, device: Device) -> str:
    """The activations' format: the engine's ``--dtype`` on ``local`` (fp32 or bf16, its two
    compute types here), bf16 on the table's devices."""
    return config.dtype if device.name == "local" and config.dtype == "fp32" else "bf16"


def kv_format_of(config: EngineConfig, device: Device) -> KVFormatSpec:
    """The KV format of the setting's ``--kv-*`` options: ``auto`` is the compute format (the
    engine's choice)."""
    return config.kv_format_spec(compute_format_of(config, device))


def efficiency_for(device: Device, config: EngineConfig) -> tuple[Efficiency, str | None]:
    """The factors that price a setting's steps on ``device``, and a line to print or None.

    On ``local``: the ``probe --steps`` fit of the setting's retention policy, else the
    full-retention fit with a line saying the retention cost is not calibrated and how to
    calibrate it (:func:`kvledger.ledger.local_fits.local_efficiency`); the assumed defaults
    before any fit. A table device: the assumed defaults, whatever the policy. A request whose
    trace ``sampling`` names its own policy is priced with the setting's fit all the same.

    Raises:
        ConfigError: a corrupt ``local_step_model.json``.
    """
    if device.name == "local":
        return local_efficiency(device, config.retention)
    return DEFAULT_EFFICIENCY, None


def num_blocks_for(spec: ModelSpec, device: Device, s: Setting, weights_dtype: str | None,
                   tp: int) -> tuple[int, int]:
    """(pool blocks, bytes per block) of a setting (see the module docstring)."""
    c = s.config
    bpb = kv_bytes_per_block(spec, kv_format_of(c, device), tp, c.block_size)
    if device.name == "local" or c.num_blocks is not None or c.kv_cache_gib is not None:
        return pool_blocks(c, bpb, spec.max_position_embeddings), bpb
    plan = PlanOptions()
    weights = spec_weight_bytes(spec, weights_dtype) // tp
    pool = kv_pool_bytes(device.memory_bytes, weights, int(plan.reserve_gib * GiB), plan.gpu_util)
    blocks = blocks_for(pool, bpb)
    if blocks < 1:
        raise InvalidParameterError(
            f"{spec.name} leaves no KV room on {device.name} ({device.memory_gib} GiB, weights "
            f"{weights / GiB:.1f} GiB per rank): try --tp or a bigger device")
    return blocks, bpb


def simulate(trace: Trace, spec: ModelSpec, device: Device, eff: Efficiency, s: Setting,
             weights_dtype: str | None = None, step_times: str = "model",
             link_gbs: float | None = None) -> ReplayRun:
    """Replay ``trace`` under one setting (tensor-parallel ranks: its
    ``tensor_parallel_size``, the engine's ``--tp``).

    Args:
        step_times: ``model`` (the step-time model) or ``trace`` (the recorded durations; the
            model for steps past the recording).
        link_gbs: per-direction bandwidth between tensor-parallel ranks (None: the device's).
    """
    check_replayable(s.config, device, link_gbs)
    tp = s.config.tensor_parallel_size
    blocks, bpb = num_blocks_for(spec, device, s, weights_dtype, tp)
    activation_bytes = kv_format(compute_format_of(s.config, device)).bits // 8
    model = StepTimeModel(spec, device, eff, kv_format_of(s.config, device), weights_dtype, tp,
                          activation_bytes, link_gbs, s.config.block_size)
    clock = ModelClock(model)
    if step_times == "trace":
        if not trace.steps:
            raise InvalidParameterError("--step-times trace: this trace recorded no steps")
        clock = RecordedClock(trace.steps, clock)
    sim = Simulator(trace, s.config, blocks, bpb, spec.max_position_embeddings, clock, s.speed,
                    live_retention(trace.header))
    return sim.run()
