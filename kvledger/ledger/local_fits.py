"""The ``local`` device's step model: one fit of the efficiency factors per retention policy.

``kvledger probe --steps [--kv-policy ...]`` fits the factors of
:mod:`kvledger.ledger.step_model` to this machine's engine steps (:mod:`kvledger.replay.fit`)
and saves them here under the key of the policy the engine ran; ``kvledger replay --device
local`` prices each setting's steps with the fit of that setting's policy
(:func:`local_efficiency`), or with the full-retention fit and a line saying the retention
cost is not calibrated.

File ``local_step_model.json`` in the config folder (``$KVLEDGER_CONFIG_DIR``)::

    {"fits": {
      "full": {"mfu": 0.34, "mbu": 0.27, "step_overhead_s": 0.006, "seq_overhead_s": 0.0002,
               "decode_group_s": 0.004, "paged_mfu": 0.05, "weights_mbu": 1.0,
               "source": "fitted by kvledger probe --steps on ...",
               "peaks": {"tflops": 0.001, "bandwidth_gbs": 16.6},
               "fit": {"samples": 47, "median_rel_error": 0.047, "p90_rel_error": 0.103,
                       "kv_format": "bf16", "retention": {"policy": "full", ...}, ...}},
      "sinks/cache": {...},
      "h2o/per-head": {...}}}

- key (:func:`fit_key`): the policy's name and the mode that changes its code path, never its
  sizes: ``full``; ``window/<positions>`` and ``sinks/<positions>`` (``original`` or
  ``cache``: cache positions turn the sink keys as they are gathered); ``h2o/<select>`` and
  ``snapkv/<select>`` (``per-head`` keeps and scores a row per layer and KV head,
  ``per-sequence`` one row); a ``/prompt`` suffix for scope ``prompt`` (the prompt compressed
  once, then no eviction and no scoring). The sizes (window, sinks, budget) are left out because the step
  features already count the tokens a policy keeps (``step_model.kept_context``): a fit
  measured at one window prices another window by its own kept tokens, the factors being the
  cost per FLOP and per byte of the policy's code path (gather through the slot view,
  attention scoring), which the size does not change. ``fit.retention`` records the sizes the
  fit was measured at.
- ``peaks``: the local device's peaks (``kvledger probe`` measures them in the same run) the
  factors are fractions of. Every ``kvledger probe`` re-measures them, so a fit read under other
  peaks is rescaled to keep its effective FLOP/s and bytes/s (``mfu x peak``, the same for
  ``paged_mfu``, ``mbu`` and ``weights_mbu``): probing one
  policy does not shift the fits of the others.
- A file of one fit (the Efficiency fields and ``fit`` at the top level, written before
  per-policy fits) is read as the ``full`` fit, without peaks (not rescaled). A fit saved before
  ``decode_group_s``, ``paged_mfu`` and ``weights_mbu`` lacks them: their defaults price its
  steps as it was fitted (no group cost, every FLOP at ``mfu``, every byte at ``mbu``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvledger.errors import ConfigError
from kvledger.ledger.hardware import Device
from kvledger.ledger.retention import DEFAULT_POSITIONS, DEFAULT_SELECT, RetentionSpec
from kvledger.ledger.step_model import DEFAULT_EFFICIENCY, Efficiency
from kvledger.paths import config_dir

FULL = "full"
REQUIRED_FIELDS = tuple(f.name for f in dataclasses.fields(Efficiency)
                        if f.default is dataclasses.MISSING)
OPTIONAL_FIELDS = tuple(f.name for f in dataclasses.fields(Efficiency)
                        if f.name not in REQUIRED_FIELDS)
"""Fields a fit saved before them lacks (their defaults price as that fit did)."""
FLOPS_FACTORS = ("mfu", "paged_mfu")
BANDWIDTH_FACTORS = ("mbu", "weights_mbu")


def local_step_model_path() -> Path:
    """Where ``kvledger probe --steps`` saves the fits of the ``local`` device."""
    return config_dir() / "local_step_model.json"


def fit_key(spec: RetentionSpec) -> str:
    """The file's key for policy ``spec`` (see the module docstring), e.g. ``sinks/cache``."""
    scope = "/prompt" if spec.scope == "prompt" else ""
    if spec.policy in ("window", "sinks"):
        return f"{spec.policy}/{spec.positions}{scope}"
    if spec.policy in ("h2o", "snapkv"):
        return f"{spec.policy}/{spec.select}{scope}"
    return FULL


def probe_command(spec: RetentionSpec) -> str:
    """The ``kvledger probe`` command that calibrates ``spec``'s key (its sizes, and the mode
    flags where they are not the defaults)."""
    flags = [f"--kv-policy {spec.policy}"]
    if spec.policy != "snapkv":
        flags.append(f"--kv-window {spec.window}")
    if spec.policy in ("sinks", "h2o"):
        flags.append(f"--kv-sinks {spec.sinks}")
    if spec.budget is not None:
        flags.append(f"--kv-budget {spec.budget}")
    if spec.policy in ("window", "sinks") and spec.positions != DEFAULT_POSITIONS:
        flags.append(f"--kv-positions {spec.positions}")
    if spec.select not in (None, DEFAULT_SELECT):
        flags.append(f"--kv-select {spec.select}")
    if spec.scope == "prompt":
        flags.append("--kv-scope prompt")
    return "kvledger probe --steps --no-kernels " + " ".join(flags)


def _read() -> dict[str, dict]:
    """The file's entries by key ({} before any fit; an old one-fit file as ``full``).

    Raises:
        ConfigError: the file is not JSON or not of this shape.
    """
    path = local_step_model_path()
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is corrupt ({exc}); run `kvledger probe --steps` again") \
            from None
    if isinstance(data, dict) and "fits" not in data and "mfu" in data:
        return {FULL: data}
    if not isinstance(data, dict) or not isinstance(data.get("fits"), dict):
        raise ConfigError(f"{path} is not a step model file (no 'fits' object); run "
                          "`kvledger probe --steps` again")
    return data["fits"]


def save_fit(spec: RetentionSpec, eff: Efficiency, device: Device, stats: dict) -> Path:
    """Store ``eff`` as the fit of ``spec``'s key (replacing that key's fit, keeping the
    others), with the peaks of ``device`` it is relative to and the figures ``stats`` of the
    fit; returns the file written.

    Raises:
        ConfigError: the existing file is corrupt.
    """
    fits = _read()
    fits[fit_key(spec)] = dataclasses.asdict(eff) | {
        "peaks": {"tflops": device.tflops, "bandwidth_gbs": device.bandwidth_gbs},
        "fit": stats | {"retention": spec.as_dict()}}
    path = local_step_model_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"fits": fits}, indent=2) + "\n")
    return path


def load_fits(device: Device) -> dict[str, Efficiency]:
    """The saved fits by key, rescaled to ``device``'s peaks (see the module docstring).

    Raises:
        ConfigError: the file is corrupt.
    """
    out = {}
    for key, entry in _read().items():
        try:
            eff = Efficiency(**{k: entry[k] for k in REQUIRED_FIELDS},
                             **{k: entry[k] for k in OPTIONAL_FIELDS if k in entry})
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"{local_step_model_path()}: fit {key!r} is incomplete ({exc}); "
                              "run `kvledger probe --steps` again") from None
        peaks = entry.get("peaks")
        if peaks:
            scale = dict.fromkeys(FLOPS_FACTORS, peaks["tflops"] / device.tflops) | \
                dict.fromkeys(BANDWIDTH_FACTORS, peaks["bandwidth_gbs"] / device.bandwidth_gbs)
            eff = dataclasses.replace(eff, **{k: getattr(eff, k) * x for k, x in scale.items()
                                              if getattr(eff, k) is not None})
        out[key] = eff
    return out


def local_efficiency(device: Device, spec: RetentionSpec) -> tuple[Efficiency, str | None]:
    """The factors that price steps under policy ``spec`` on ``device`` (the ``local`` one).

    Returns:
        (the fit of ``spec``'s key if saved; else the ``full`` fit, or the assumed defaults
        before any ``probe --steps``, its ``source`` saying so; a line to print when the
        policy's retention cost is not calibrated, else None).

    Raises:
        ConfigError: the file is corrupt.
    """
    fits = load_fits(device)
    key = fit_key(spec)
    if key in fits:
        return fits[key], None
    eff = fits.get(FULL, DEFAULT_EFFICIENCY)
    if key == FULL:
        return eff, None
    used = "full-retention fit" if FULL in fits else "assumed defaults"
    eff = dataclasses.replace(eff, source=f"{eff.source}; {key} not calibrated, the {used}")
    note = (f"retention cost not calibrated: no local step fit for {key}, so {spec.describe()} "
            f"is priced with the {used}; calibrate it with `{probe_command(spec)}`")
    return eff, note
