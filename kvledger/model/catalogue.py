"""The model catalogue: Hugging Face ``config.json`` files shipped inside the package.

``kvledger plan meta-llama/Llama-3.1-8B`` must work offline, so the planner resolves a Hugging
Face id against the configs in ``kvledger/data/configs/`` (package data, see
:mod:`kvledger.data`; their provenance is in ``SOURCES.md`` beside them). A file named
``owner__name.json`` is the config of the id ``owner/name``; ids match case-insensitively, as
the Hub's do. No torch here.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvledger.errors import ModelNotFoundError
from kvledger.spec import CONV, FULL, LINEAR, MAMBA, MLA, SLIDING, ModelSpec

ID_SEPARATOR = "__"  # stands for the "/" of an HF id in a file name
LAYER_KIND_SHORT = {FULL: "full", SLIDING: "sliding", MLA: "mla", LINEAR: "linear",
                    CONV: "conv", MAMBA: "mamba"}


@dataclass(frozen=True)
class CatalogueEntry:
    """One shipped config: its Hugging Face id and the file holding it."""

    model_id: str
    path: Path


@cache
def entries() -> tuple[CatalogueEntry, ...]:
    """Every shipped config, sorted by id (case-insensitive)."""
    from kvledger.data import configs_dir

    found = [CatalogueEntry(path.stem.replace(ID_SEPARATOR, "/", 1), path)
             for path in configs_dir().glob("*.json") if ID_SEPARATOR in path.stem]
    return tuple(sorted(found, key=lambda e: e.model_id.lower()))


def find(model_id: str) -> CatalogueEntry | None:
    """The entry whose id equals ``model_id`` ignoring case, or None."""
    wanted = model_id.strip().lower()
    return next((e for e in entries() if e.model_id.lower() == wanted), None)


def closest_ids(model_id: str, n: int = 3) -> list[str]:
    """Up to ``n`` catalogue ids most like ``model_id`` (difflib ratio over lower-cased ids;
    the name after the owner counts too, so ``llama-3.1-8b`` finds ``meta-llama/Llama-3.1-8B``)."""
    by_key: dict[str, str] = {}
    for e in entries():
        by_key.setdefault(e.model_id.lower(), e.model_id)
        by_key.setdefault(e.model_id.split("/")[-1].lower(), e.model_id)
    keys = difflib.get_close_matches(model_id.strip().lower(), list(by_key), n=2 * n, cutoff=0.4)
    return list(dict.fromkeys(by_key[k] for k in keys))[:n]


def catalogue_spec(entry: CatalogueEntry) -> ModelSpec:
    """The ModelSpec of a shipped config, named by its Hugging Face id.

    Shipped configs are known families, so reading them raises no warning; any that does is
    passed on to the caller.
    """
    from kvledger.model.families import load_spec

    spec = load_spec(entry.path)
    return dataclasses.replace(spec, name=entry.model_id)


def lookup(model_id: str) -> CatalogueEntry:
    """The entry of ``model_id`` (case-insensitive).

    Raises:
        ModelNotFoundError: no such id; the message names the closest ids and
            ``kvledger models``.
    """
    entry = find(model_id)
    if entry is not None:
        return entry
    close = closest_ids(model_id)
    hint = f"; closest: {', '.join(close)}" if close else ""
    raise ModelNotFoundError(
        f"{model_id!r} is neither a local path (config.json, HF folder, GGUF file) nor a model "
        f"in the catalogue{hint} (list them with `kvledger models`)"
    )


def is_path_like(model: str) -> bool:
    """True when ``model`` can only be a path: absolute, starting with ``.`` or ``~``, ending
    in ``.json`` / ``.gguf``, or with more than one ``/`` (an HF id is ``owner/name``)."""
    return (model.startswith(("/", ".", "~")) or model.endswith((".json", ".gguf"))
            or model.count("/") > 1 or "\\" in model)


def load_model_spec(model: str) -> ModelSpec:
    """ModelSpec of ``model``: ``"default"``, an existing local path or anything path-like as
    :func:`load_spec` reads it, else a Hugging Face id from the catalogue.

    Raises:
        ModelNotFoundError: a path-like name that does not exist, or an id that is neither a
            local path nor in the catalogue (see :func:`lookup`).
        ConfigError, UnsupportedModelError: as :func:`kvledger.spec.load_spec`.
    """
    from kvledger.model.families import load_spec

    if model == "default" or is_path_like(model) or Path(model).expanduser().exists():
        return load_spec(model)
    return catalogue_spec(lookup(model))


def layer_kinds_summary(spec: ModelSpec) -> str:
    """Counts of layer kinds in order of first appearance, e.g. ``"sliding 21 + full 21"``."""
    counts: dict[str, int] = {}
    for kind in spec.layers.types:
        counts[kind] = counts.get(kind, 0) + 1
    return " + ".join(f"{LAYER_KIND_SHORT.get(k, k)} {n}" for k, n in counts.items())


def catalogue_rows(kv_format: str = "bf16") -> list[dict]:
    """One row per shipped config: id, model type, layers, layer kinds, KV heads, head_dim, the
    MLA latent width (None without MLA) and KV bytes per token (all layers storing per-token
    KV, ``kv_format``; as ``plan --json``)."""
    from kvledger.ledger.kv import kv_bytes_per_token
    from kvledger.ledger.kv_format import KVFormatSpec
    from kvledger.ledger.planner import PlanOptions

    fmt, block_size = KVFormatSpec(kv_format), PlanOptions.block_size

    rows = []
    for entry in entries():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spec = catalogue_spec(entry)
        rows.append({
            "model_id": entry.model_id,
            "model_type": spec.model_type,
            "num_layers": spec.num_layers,
            "layer_kinds": layer_kinds_summary(spec),
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            # MLA caches one latent (kv_lora_rank + qk_rope_head_dim), not per-head K and V
            "mla_latent_dim": spec.latent.kv_lora_rank + spec.latent.qk_rope_head_dim
            if MLA in spec.layers.types else None,
            "kv_bytes_per_token": kv_bytes_per_token(spec, fmt, 1, block_size),
            "max_position_embeddings": spec.max_position_embeddings,
        })
    return rows
