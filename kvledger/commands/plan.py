"""``kvledger plan``: the ledger's bill for a model on a device.

``plan`` renders :class:`kvledger.ledger.planner.Plan` as rich tables (or ``--json``, the
contract in the planner) and can draw KV bytes and concurrency against context (``--plot``).
It never imports torch (``kvledger probe``, in :mod:`kvledger.commands.probe`, measures the
``local`` device).
"""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from kvledger.commands.engine_options import field_help
from kvledger.errors import InvalidParameterError
from kvledger.ledger.planner import DEFAULT_CONTEXTS, parse_contexts

Opt = typer.Option


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _disk_speed(read_gbps: float | None, kv_disk_dir: str | None) -> tuple[float | None, float]:
    """(GB/s, seconds per file) of ``--disk-read-gbps`` or of the probe's cold figures for
    ``--kv-disk-dir``.

    Raises:
        InvalidParameterError: both given, a speed <= 0, or a directory never probed.
    """
    if kv_disk_dir is None:
        if read_gbps is not None and read_gbps <= 0:
            raise InvalidParameterError(f"--disk-read-gbps must be positive, got {read_gbps}")
        return read_gbps, 0.0
    if read_gbps is not None:
        raise InvalidParameterError("give --disk-read-gbps or --kv-disk-dir, not both")
    from kvledger.ledger.tier_load import saved_figures
    from kvledger.paths import config_dir

    cold = saved_figures(Path(kv_disk_dir), config_dir()).cold
    if cold is None:
        raise InvalidParameterError(f"no read speed saved for {kv_disk_dir}: run `kvledger "
                                    f"probe --kv-disk-dir {kv_disk_dir}` first")
    return cold.bytes_per_s / 1e9, cold.file_s


def plan(
    model: Annotated[
        str, typer.Argument(help="config.json, HF folder, GGUF file, 'default', or a Hugging "
                                 "Face id from the catalogue (kvledger models)")
    ] = "default",
    context: Annotated[
        str, Opt(help="Context lengths, comma-separated (8k = 8192)")
    ] = ",".join(map(str, DEFAULT_CONTEXTS)),
    device: Annotated[
        str, Opt(help="Device name, 'custom' or 'local' (see kvledger probe)")
    ] = "H100-SXM",
    memory_gib: Annotated[float | None, Opt(help="Device memory, GiB (custom/override)")] = None,
    bandwidth_gbs: Annotated[float | None, Opt(help="Memory bandwidth, GB/s")] = None,
    tflops: Annotated[float | None, Opt(help="Dense bf16 TFLOPS")] = None,
    kv_cache_dtype: Annotated[str, Opt(
        "--kv-cache-dtype", "--kv-dtype",
        help="KV format: auto (= bf16) fp32 fp16 bf16 fp8 int8 int4")] = "bf16",
    weights_dtype: Annotated[
        str | None, Opt(help="fp32 bf16 fp16 fp8 int8 int4 (default: GGUF bytes / checkpoint)")
    ] = None,
    tensor_parallel_size: Annotated[int, Opt(
        "--tensor-parallel-size", "-tp", "--tp", help="Tensor-parallel ranks")] = 1,
    batch: Annotated[int, Opt(help="Sequences per decode step (TPOT floor)")] = 1,
    reserve_gib: Annotated[float, Opt(help="Activation reserve per device, GiB")] = 2.0,
    gpu_util: Annotated[float, Opt(help="Fraction of device memory the engine may use")] = 0.9,
    block_size: Annotated[int, Opt(help=field_help()["block_size"])] = 16,
    no_window_savings: Annotated[
        bool, Opt("--no-window-savings", help="Size sliding layers as full attention")
    ] = False,
    kv_group_size: Annotated[int | None, Opt(help="Elements per int8/int4 scale group")] = None,
    kv_outlier_frac: Annotated[float, Opt(help="Fraction of key channels kept in fp16")] = 0.0,
    kv_outlier_channels: Annotated[int | None, Opt(
        help="Key channels per layer and KV head kept in fp16 (wins over --kv-outlier-frac)")] = None,
    kv_key_quant: Annotated[str, Opt(help=field_help()["kv_key_quant"])] = "per-channel",
    kv_key_group_tokens: Annotated[int | None, Opt(
        help=field_help()["kv_key_group_tokens"])] = None,
    kv_residual_tokens: Annotated[int | None, Opt(
        help=field_help()["kv_residual_tokens"])] = None,
    kv_intact_tokens: Annotated[int | None, Opt(
        help=field_help()["kv_intact_tokens"])] = None,
    shared_prefix: Annotated[int, Opt(help="Tokens every request shares (stored once)")] = 0,
    turn_tokens: Annotated[int, Opt(help="New tokens per chat turn")] = 1024,
    mfu: Annotated[float, Opt(help="Model FLOPs utilisation for the TTFT estimate")] = 0.4,
    kv_policy: Annotated[str | None, Opt(help=field_help()["kv_policy"])] = None,
    kv_window: Annotated[int | None, Opt(help=field_help()["kv_window"])] = None,
    kv_sinks: Annotated[int | None, Opt(help=field_help()["kv_sinks"])] = None,
    kv_budget: Annotated[int | None, Opt(help=field_help()["kv_budget"])] = None,
    kv_scope: Annotated[str | None, Opt(help=field_help()["kv_scope"])] = None,
    disk_read_gbps: Annotated[float | None, Opt(
        help="Disk KV tier read speed, GB/s: show from how many tokens loading a prefix beats "
             "recomputing it")] = None,
    kv_disk_dir: Annotated[str | None, Opt(
        help="Take the disk read speed (and seconds per file) that `kvledger probe "
             "--kv-disk-dir` saved for this directory")] = None,
    replicas: Annotated[int | None, Opt(
        help="Plan a fleet of this many replicas behind a router on a shared-prefix mix: "
             "round robin against prefix-aware routing (docs/fleet.md)")] = None,
    target_rps: Annotated[float | None, Opt(
        help="Fleet plan: requests per second over the fleet (TTFT at this load)")] = None,
    ttft_p90: Annotated[float | None, Opt(
        help="Fleet plan: TTFT p90 to meet, seconds (how many replicas it takes)")] = None,
    prefixes: Annotated[int, Opt(help="Fleet plan: shared prefixes (system prompts)")] = 8,
    prefix_tokens: Annotated[int, Opt(help="Fleet plan: tokens of each shared prefix")] = 1000,
    unique_tokens: Annotated[int, Opt(help="Fleet plan: each request's own prompt tokens")] = 100,
    output_tokens: Annotated[int, Opt(help="Fleet plan: output tokens per request")] = 32,
    fleet_requests: Annotated[int, Opt(
        help="Fleet plan: requests in the run, for the cold misses (0: steady state)")] = 0,
    replica_blocks: Annotated[int | None, Opt(
        help="Fleet plan: KV blocks of a replica's pool (default: what the device holds)")] = None,
    max_num_seqs: Annotated[int, Opt(help=field_help()["max_num_seqs"])] = 64,
    draft_model: Annotated[str | None, Opt(
        help="A draft model for speculative decoding (as MODEL): its weights and KV in the "
             "pool, and the cost of a verify step per k with the acceptance it needs")] = None,
    num_speculative_tokens: Annotated[int, Opt(
        help="With --draft-model: the largest k of the verify rows")] = 5,
    step_prices: Annotated[str | None, Opt(
        help='Fleet plan: a replica\'s measured step prices, JSON {"prefill_token_s", '
             '"step_s", "decode_seq_s"} in seconds (default: the replay\'s step model)')] = None,
    json_out: Annotated[bool, Opt("--json", help="Print the plan as JSON")] = False,
    plot: Annotated[
        Path | None, Opt(help="Write KV and concurrency vs context to this PNG")
    ] = None,
) -> None:
    """KV, weights, concurrency, TTFT and TPOT of MODEL at each context on a device; with
    --replicas or --target-rps, a fleet of replicas behind a router."""
    from kvledger.ledger.hardware import get_device
    from kvledger.ledger.planner import PlanOptions
    from kvledger.ledger.planner import plan as make_plan
    from kvledger.ledger.retention import spec_from_options
    from kvledger.model.catalogue import load_model_spec

    if turn_tokens <= 0:
        raise InvalidParameterError(f"--turn-tokens must be positive, got {turn_tokens}")
    contexts = parse_contexts(context)
    disk_read_gbps, disk_file_s = _disk_speed(disk_read_gbps, kv_disk_dir)
    dev = get_device(device, memory_gib, bandwidth_gbs, tflops)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = load_model_spec(model)
    for w in caught:
        _warn(str(w.message))
    options = PlanOptions(
        contexts=contexts,
        kv_format="bf16" if kv_cache_dtype == "auto" else kv_cache_dtype,
        weights_dtype=weights_dtype,
        tp=tensor_parallel_size,
        batch=batch,
        reserve_gib=reserve_gib,
        gpu_util=gpu_util,
        block_size=block_size,
        window_aware=not no_window_savings,
        kv_group_size=kv_group_size,
        kv_outlier_frac=kv_outlier_frac,
        kv_outlier_channels=kv_outlier_channels,
        kv_key_quant=kv_key_quant,
        kv_key_group_tokens=kv_key_group_tokens,
        kv_residual_tokens=kv_residual_tokens,
        kv_intact_tokens=kv_intact_tokens,
        shared_prefix=shared_prefix,
        turn_tokens=turn_tokens,
        mfu=mfu,
        retention=spec_from_options(kv_policy, kv_window, kv_sinks, kv_budget, scope=kv_scope),
        disk_read_gbps=disk_read_gbps,
        disk_file_s=disk_file_s,
    )
    result = make_plan(spec, dev, options)
    fleet = replicas is not None or target_rps is not None
    draft = None
    if draft_model is not None:
        from kvledger.ledger.draft_plan import draft_plan

        if fleet:
            raise InvalidParameterError("--draft-model sizes one replica: drop --replicas and "
                                        "--target-rps")
        draft = draft_plan(spec, load_model_spec(draft_model), dev, options, result,
                           num_speculative_tokens)
    for message in result.warnings if not fleet else ():  # about the contexts, not a fleet
        _warn(message)
    if fleet:
        from kvledger.commands.plan_fleet import run as plan_fleet
        from kvledger.ledger.fleet import SharedPrefixMix

        mix = SharedPrefixMix(prefixes, prefix_tokens, unique_tokens, output_tokens,
                              fleet_requests)
        plan_fleet(result, spec, mix, replicas or 1, replica_blocks, max_num_seqs, target_rps,
                   ttft_p90, json_out, step_prices)
        return
    if plot is not None:
        from kvledger.ledger.plan_plot import write_plot

        try:
            write_plot(spec, dev, options, plot)
        except OSError as exc:
            raise InvalidParameterError(f"cannot write the plot to {plot}: {exc}") from None
    if json_out:
        out = result.to_json()
        if draft is not None:
            out["draft"] = asdict(draft)
        print(json.dumps(out, indent=2))
    else:
        from kvledger.commands.plan_render import render, render_draft

        render(result)
        if draft is not None:
            render_draft(draft)
        if plot is not None:
            print(f"plot written to {plot}")
