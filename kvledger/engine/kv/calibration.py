"""KV calibration files: per layer and KV head, the magnitude of every K and V channel.

``kvledger calibrate`` writes one (JSON); ``--kv-calibration FILE`` loads it; the bundled model
ships its own in ``kvledger/data/calibration/<model>.json`` (found with ``importlib.resources``),
so the default needs no step. The engine uses ``key_absmax`` to choose the outlier channels:
per layer and KV head, the ``--kv-outlier-channels`` channels of largest absolute key value.

Fields: ``kvledger_calibration`` (format version, 1), ``model`` (the model's name),
``num_layers``, ``num_kv_heads``, ``head_dim``, ``key_absmax`` and ``value_absmax``
([layers][kv_heads][head_dim] floats), ``rotation`` (the basis they were measured in,
``KVFormatSpec.rotation``; absent = ``none``), plus what was run (``text``, ``tokens``) and the
error tables of the calibration report.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

from kvledger.errors import InvalidParameterError
from kvledger.spec import ModelSpec

VERSION = 1


def shipped_path(model_name: str) -> Path | None:
    """The calibration shipped in the package for ``model_name``, or None."""
    path = Path(str(resources.files("kvledger.data") / "calibration" / f"{model_name}.json"))
    return path if path.is_file() else None


def load_calibration(path: Path, spec: ModelSpec, model_name: str,
                     rotation: str = "none") -> dict:
    """The calibration in ``path``, checked against the model and the format's ``rotation``.

    Raises:
        InvalidParameterError: unreadable or corrupt file, one made for another model or in
            another rotation's basis.
    """
    try:
        data = json.loads(Path(path).read_text())
        shape = (data["num_layers"], data["num_kv_heads"], data["head_dim"])
        keys = torch.tensor(data["key_absmax"], dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidParameterError(
            f"--kv-calibration {path}: not a readable calibration file ({exc})") from None
    if data.get("kvledger_calibration") != VERSION or tuple(keys.shape) != shape:
        raise InvalidParameterError(f"--kv-calibration {path}: corrupt calibration file")
    want = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    if data.get("model") != model_name or shape != want:
        raise InvalidParameterError(
            f"--kv-calibration {path} is for model {data.get('model')!r} {shape}, not "
            f"{model_name!r} {want} (run kvledger calibrate on this model)")
    if data.get("rotation", "none") != rotation:
        raise InvalidParameterError(
            f"--kv-calibration {path} was measured with rotation {data.get('rotation', 'none')!r}"
            f", not --kv-rotation {rotation} (run kvledger calibrate --kv-rotation {rotation})")
    data["key_absmax"] = keys
    return data


def outlier_index(config, spec: ModelSpec, layout) -> torch.Tensor | None:
    """[layers, kv_heads, n] long: each layer and head's ``n`` largest key channels (sorted),
    or None when the layout keeps no outliers.

    Raises:
        InvalidParameterError: outliers asked for without a calibration, or a bad file.
    """
    n = layout.fmt.outlier_channels
    if not n:
        return None
    from kvledger.paths import model_id, resolve_model_path

    name = model_id(resolve_model_path(config.model))
    path = Path(config.kv_calibration) if config.kv_calibration else shipped_path(name)
    if path is None:
        raise InvalidParameterError(
            f"--kv-outlier-channels needs a calibration of {name}: run kvledger calibrate "
            "--out FILE, then pass --kv-calibration FILE")
    absmax = load_calibration(path, spec, name, layout.fmt.rotation)["key_absmax"]
    return absmax.topk(n, dim=-1).indices.sort(dim=-1).values
