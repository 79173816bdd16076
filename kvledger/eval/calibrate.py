"""Calibration: per layer and KV head, how large each K and V channel gets on real text, which
key channels to keep in fp16, and what a quantized format loses there.

Text runs through the engine with full-precision KV (``eval.scoring``, chunks of ``context``
tokens); after each chunk the cached K/V of every layer are read from the store (and rotated
by the format's ``rotation``, the basis its codes and outlier channels live in): channel
magnitudes (max |x| over the tokens) and, per layer and KV head, the relative error
||x - codec(x)|| / ||x|| of the chosen format's round trip on the keys, without and with the
outlier channels, and on the values. The KL divergence of the next-token distribution against
full-precision KV, for the format with the chosen outliers, comes from
:func:`kvledger.eval.perplexity.perplexity` over the same chunks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvledger.engine.kv.calibration import VERSION
from kvledger.eval.scoring import step_logprobs
from kvledger.ledger.kv_format import KVFormatSpec


@dataclass
class Calibration:
    """What :func:`calibrate` measured ([layers, kv_heads, head_dim] magnitudes,
    [layers, kv_heads] errors)."""

    model: str
    kv_format: str
    rotation: str
    outlier_channels: int
    tokens: int
    key_absmax: torch.Tensor
    value_absmax: torch.Tensor
    key_error: torch.Tensor
    key_error_outliers: torch.Tensor
    value_error: torch.Tensor
    kld_mean: float | None = None
    delta_ppl_pct: float | None = None

    @property
    def outliers(self) -> torch.Tensor:
        """[layers, kv_heads, n] the chosen key channels (largest magnitude), sorted."""
        return self.key_absmax.topk(self.outlier_channels, -1).indices.sort(-1).values

    def to_json(self, text: str) -> dict:
        """The calibration file (``--kv-calibration``) and ``--json`` object."""
        spec_shape = self.key_absmax.shape
        return {"kvledger_calibration": VERSION, "model": self.model, "text": text,
                "tokens": self.tokens, "num_layers": spec_shape[0],
                "num_kv_heads": spec_shape[1], "head_dim": spec_shape[2],
                "kv_format": self.kv_format, "rotation": self.rotation,
                "outlier_channels": self.outlier_channels,
                "outliers": self.outliers.tolist(), "kld_mean": self.kld_mean,
                "delta_ppl_pct": self.delta_ppl_pct,
                "key_error": self.key_error.tolist(),
                "key_error_outliers": self.key_error_outliers.tolist(),
                "value_error": self.value_error.tolist(),
                "key_absmax": self.key_absmax.tolist(),
                "value_absmax": self.value_absmax.tolist()}

    def write(self, path: Path, text: str) -> None:
        """Write the calibration file."""
        Path(path).write_text(json.dumps(self.to_json(text)))


def _rel_error(codec, x: torch.Tensor) -> torch.Tensor:
    """[kv_heads] ||x - codec(x)|| / ||x|| over blocks x [n, bs, kv_heads, D]."""
    diff = codec.decode(codec.encode(x), torch.float32) - x
    dims = (0, 1, 3)
    return diff.pow(2).sum(dims).sqrt() / x.pow(2).sum(dims).sqrt().clamp_min(1e-12)


def calibrate(engine, chunks: list[list[int]], fmt: KVFormatSpec) -> Calibration:
    """Run ``chunks`` through ``engine`` (full-precision KV) and measure the quantized format
    ``fmt`` (its ``outlier_channels`` the count to choose); see the module doc.

    Raises:
        InvalidParameterError: a layout the model cannot take (group size, outliers).
    """
    from kvledger.engine.kv.codecs import make_codecs
    from kvledger.engine.kv.layout import resolve_format
    from kvledger.engine.kv.rotation import rotation_matrix

    spec, store = engine.spec, engine.store
    layers, heads, dim = spec.num_layers, spec.num_kv_heads, spec.head_dim
    fmt = resolve_format(fmt, dim)
    kv_format, n_out, key_quant = fmt.name, fmt.outlier_channels, fmt.key_quant
    group = fmt.group_size or dim
    keys_codec, values_codec = make_codecs(kv_format, store.block_size, heads, dim, group,
                                           key_quant)
    rotation = rotation_matrix(fmt.rotation, dim)
    absmax = [torch.zeros(layers, heads, dim) for _ in range(2)]
    blocks_seen: list[list[torch.Tensor]] = [[] for _ in range(layers)]

    def inspect(req) -> None:
        filled = req.num_computed_tokens // store.block_size
        for layer in range(layers):  # each layer through its group's table (kv_groups.py)
            group = 0 if store.group_of_layer is None else store.group_of_layer[layer]
            full = torch.tensor([b for b in req.block_tables[group][:filled] if b >= 0],
                                dtype=torch.int64)
            k, v = (x.float() if rotation is None else x.float() @ rotation
                    for x in store.read_blocks(layer, full))
            absmax[0][layer] = torch.maximum(absmax[0][layer], k.abs().amax(dim=(0, 1)).float())
            absmax[1][layer] = torch.maximum(absmax[1][layer], v.abs().amax(dim=(0, 1)).float())
            blocks_seen[layer].append(torch.stack([k, v]).float())

    for chunk in chunks:
        for _ in step_logprobs(engine, chunk, len(chunk), len(chunk), inspect):
            pass
    result = Calibration(engine.model_name, kv_format, fmt.rotation, n_out, sum(map(len, chunks)),
                         absmax[0], absmax[1], torch.zeros(layers, heads),
                         torch.zeros(layers, heads), torch.zeros(layers, heads))
    with_outliers, _ = make_codecs(kv_format, store.block_size, heads, dim, group, key_quant,
                                   result.outliers if n_out else None)
    for layer in range(layers):
        kv = torch.cat(blocks_seen[layer], dim=1)  # [2, n, bs, heads, D]
        result.key_error[layer] = _rel_error(keys_codec, kv[0])
        out_codec = with_outliers[layer] if isinstance(with_outliers, list) else with_outliers
        result.key_error_outliers[layer] = _rel_error(out_codec, kv[0])
        result.value_error[layer] = _rel_error(values_codec, kv[1])
    return result


def write_heatmap(cal: Calibration, path: Path) -> None:
    """PNG: relative error by layer x KV head for keys, keys with outliers, and values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("keys", cal.key_error), (f"keys, {cal.outlier_channels} fp16 outliers",
                                        cal.key_error_outliers), ("values", cal.value_error)]
    fig, axes = plt.subplots(1, 3, figsize=(10, 6), sharey=True)
    top = max(float(t.max()) for _, t in panels)
    for ax, (title, err) in zip(axes, panels):
        im = ax.imshow(err.numpy(), aspect="auto", cmap="magma", vmin=0, vmax=top)
        ax.set_title(title)
        ax.set_xlabel("KV head")
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=axes, label=f"relative error ({cal.kv_format})")
    fig.suptitle(f"{cal.model}: {cal.kv_format} round-trip error per layer and KV head")
    fig.savefig(path, dpi=100)
    plt.close(fig)
