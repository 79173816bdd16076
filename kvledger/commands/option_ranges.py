"""The allowed range of every numeric command-line option, checked before a command runs.

One table, :data:`OPTION_RANGES`, by the option's parameter name: the engine's options from
``EngineConfig``'s own table (``engine/config.py``), the other commands' below (a name means
the same in every command that has it: ``--seed``, ``--block-size``, ``--context``).
:func:`check_options` runs in the CLI's wrapper (``cli.user_errors``) on the values typer
parsed, so NaN, an infinity (``1e400``), a huge integer or a value out of range is one
``error: --flag must be ...`` line and exit 2 before anything loads, never a traceback later.
Typer itself refuses text that is no number (exit 2, naming the option). Every numeric option
of every command has a row (``tests/commands/test_option_ranges.py``), and
``docs/validation.md`` lists them.
"""

from __future__ import annotations

import dataclasses

import click

from kvledger.commands.engine_options import ENGINE_PARAMETERS
from kvledger.engine.config import ENGINE_RANGES
from kvledger.ranges import Range

_COUNT = Range(1, 1 << 31, hi_open=True)
_SIZE = Range(0, 1 << 31, hi_open=True)
_SECONDS = Range(0, 1 << 20, integer=False, lo_open=True)  # up to 12 days
_POSITIVE = Range(0, 1 << 30, integer=False, lo_open=True)  # a rate, a speed, a size in GiB
_SHARE = Range(0, 1, integer=False, lo_open=True)
_SEED = Range(-(1 << 63), 1 << 63, hi_open=True)  # int64, as the HTTP API's

COMMAND_RANGES: dict[str, Range] = {
    # plan
    "memory_gib": _POSITIVE, "bandwidth_gbs": _POSITIVE, "tflops": _POSITIVE,
    "batch": Range(1, 1 << 20), "reserve_gib": Range(0, 1 << 30, integer=False),
    "gpu_util": _SHARE, "kv_outlier_frac": Range(0, 1, integer=False),
    "shared_prefix": _SIZE, "turn_tokens": _COUNT, "mfu": _SHARE,
    "disk_read_gbps": _POSITIVE,
    # plan: the fleet
    "replicas": Range(1, 1 << 20, optional=True), "target_rps": _POSITIVE, "ttft_p90": _SECONDS,
    "prefixes": _COUNT, "prefix_tokens": _COUNT, "unique_tokens": _COUNT,
    "output_tokens": _COUNT, "fleet_requests": _SIZE, "replica_blocks": _COUNT,
    # plan: a draft model (one verify row per k up to this)
    "num_speculative_tokens": Range(1, 64),
    # probe
    "buffer_mib": Range(1, 1 << 20), "matmul_n": Range(1, 1 << 16), "repeats": Range(1, 1 << 20),
    # generate, chat
    "max_tokens": _COUNT, "max_output_tokens": _COUNT,
    "temperature": Range(0, None, integer=False), "top_p": _SHARE, "top_k": Range(-1, 1 << 31,
                                                                                  hi_open=True),
    "seed": _SEED,
    # serve
    "port": Range(1, 65535), "state_max_gib": _POSITIVE, "state_quota_mib": _POSITIVE,
    "segment_turns": Range(1, 1 << 20), "max_queue": _COUNT, "kv_alert_bytes":
    Range(1, 1 << 63, hi_open=True), "log_interval_s": _SECONDS, "max_body_bytes": _COUNT,
    "body_timeout_s": _SECONDS, "header_timeout_s": _SECONDS, "max_header_bytes": _COUNT,
    "request_timeout_s": _SECONDS, "max_concurrent_streams": _COUNT, "max_input_chars": _COUNT,
    "max_input_items": _COUNT, "max_stop_strings": _COUNT, "max_stop_chars": _COUNT,
    "max_tools": _COUNT, "max_prompt_logprob_entries": _COUNT, "send_timeout_s": _SECONDS,
    "drain_timeout_s": _SECONDS,
    # bench
    "output_len": _COUNT, "requests": _COUNT, "request_rate": _POSITIVE,
    "turns": Range(1, 1 << 20), "warmup": Range(0, 1 << 20), "timeout": _SECONDS,
    # calibrate, eval
    "context": _COUNT, "chunks": Range(1, 1 << 20), "stride": _COUNT, "trials": Range(1, 1 << 20),
    # replay
    "link_gbs": _POSITIVE, "speed": _POSITIVE, "max_requests": _COUNT,
}
"""A command's own numeric option (by parameter name) -> its allowed range."""

OPTION_RANGES: dict[str, Range] = {
    **{ENGINE_PARAMETERS[name]: allowed for name, allowed in ENGINE_RANGES.items()},
    **COMMAND_RANGES}
"""Every numeric option's parameter name -> its allowed range."""


def check_options(values: dict) -> None:
    """Check the numeric options a command was given (None: not given) against the table,
    naming each by its flag (the current click command's).

    Raises:
        InvalidParameterError: the first value outside its range.
    """
    ctx = click.get_current_context(silent=True)
    flags = {p.name: p.opts[0] for p in ctx.command.params} if ctx is not None else {}
    for name, value in values.items():
        allowed = OPTION_RANGES.get(name)
        if allowed is not None and isinstance(value, int | float) and not isinstance(value, bool):
            given = dataclasses.replace(allowed, optional=False)  # a flag cannot say none
            given.check(flags.get(name, "--" + name.replace("_", "-")), value)
