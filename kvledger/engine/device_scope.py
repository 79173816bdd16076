"""What the engine runs on a device other than the CPU (today the CUDA device), refused by name
at start when asked for: the placement of a model's tensors on the device
(``kvledger.device.placement``) and the device paths of the step are written for the plain
attention decoder (dense MLPs, full and sliding attention layers, full-precision and
quantized KV stores), not yet for MLA's latent pool, state layers, routed experts, tensor
parallelism, speculative decoding, retention policies other than ``full``, or the KV tiers
(docs/gpu.md lists them)."""

from __future__ import annotations

from kvledger.errors import InvalidParameterError
from kvledger.spec import MLA, STATE_KINDS, ModelSpec


def refuse_off_cpu(device_name: str, config, spec: ModelSpec) -> None:
    """Raise InvalidParameterError naming the first thing ``config`` / ``spec`` asks for that
    the engine does not run on device ``device_name`` yet; nothing on the CPU."""
    if device_name == "cpu":
        return
    kinds = set(spec.layers.types)
    moe = any(spec.is_moe_layer(i) for i in range(spec.num_layers))
    reasons = (
        (MLA in kinds, f"MLA (multi-head latent attention, {spec.model_type})"),
        (bool(kinds & set(STATE_KINDS)), f"state layers ({spec.model_type})"),
        (moe, f"routed experts (MoE, {spec.model_type})"),
        (config.tensor_parallel_size > 1, "tensor parallelism"),
        (config.speculative.enabled, "speculative decoding"),
        (config.retention.policy != "full", _policy(config.retention.policy)),
        (config.kv_disk_dir is not None or config.kv_ram_gib is not None,
         "the KV tiers (--kv-disk-dir, --kv-ram-gib)"),
    )
    for bad, what in reasons:
        if bad:
            _refuse(device_name, what)


def refuse_policy_off_cpu(device_name: str, policy: str) -> None:
    """Raise InvalidParameterError when a request asks device ``device_name`` (not the CPU)
    for a retention policy other than ``full``."""
    if device_name != "cpu" and policy != "full":
        _refuse(device_name, _policy(policy))


def _policy(name: str) -> str:
    return f"the {name} retention policy"


def _refuse(device_name: str, what: str) -> None:
    raise InvalidParameterError(f"--device {device_name} does not run {what} yet; use "
                                "--device cpu (docs/gpu.md)")
