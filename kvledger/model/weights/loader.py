"""Model weights and tokenizer from a GGUF file or a Hugging Face folder (or dummy weights).

``load_weights`` returns the ModelSpec and a state dict with Hugging Face ``LlamaForCausalLM``
parameter names (``model.embed_tokens.weight`` [vocab, hidden], ``model.layers.{i}.self_attn.
{q,k,v,o}_proj.weight`` [out, in], ..., ``model.norm.weight``; ``lm_head.weight`` only when the
head is untied; the biases and extra norms of :func:`.names.tensor_shapes` when the spec has
them), every family brought to those names by :func:`.names.to_common_names` (its family's
renames first: ``kvledger.model.families``). A model type no family of the engine runs exactly
is refused (``kvledger.model.families.check_runnable``) before any tensor is read.
``load_format="dummy"``: :mod:`.dummy`.

Sources:
  * K-quant GGUF file (Q4_K, Q5_K, Q6_K matrices): matrices kept as the file's blocks, read
    at each load (:func:`kvledger.model.weights.gguf_tensors.gguf_block_state`).
  * Other GGUF file: tensors dequantized by :mod:`kvledger.model.weights.gguf_tensors` (fp32, Q/K rows
    un-permuted). Dequantizing and parsing the header take seconds, so the state dict in the
    requested dtype and the spec (as JSON in the safetensors metadata) are cached under
    ``cache_dir()/weights/<key>-<dtype>.safetensors`` (one file per dtype, so a hit is a plain
    memory map with no conversion), written atomically (temp file + rename). The key is sha256
    over (format version, file size, mtime_ns, first MiB, last MiB): cheap (no full hash of a
    multi-GB file) and it changes whenever the file is replaced or rewritten.
  * Hugging Face folder: ``config.json`` (through ``kvledger.spec``) plus ``*.safetensors``
    (one file, several shards, or the shards named by ``model.safetensors.index.json``).

``load_tokenizer`` returns a transformers tokenizer with its chat template; a GGUF's tokenizer
(~3.5 s to build from the GGUF vocabulary) is cached with ``save_pretrained`` under
``cache_dir()/tokenizers/<key>`` (~0.2 s to reload). transformers' ``AutoTokenizer`` refuses a
GGUF whose architecture its GGUF reader lacks (``granitehybrid``): the tokenizer is
then built from the file's tokenizer metadata alone (``PreTrainedTokenizerFast`` with
``gguf_file``: vocabulary, merges, pre-tokenizer, special tokens, chat template), which needs
no architecture.

Errors: unknown path -> ModelNotFoundError; folder without config.json or weights ->
ModelNotFoundError; not a GGUF / missing key / missing tensor -> ConfigError; unsupported
architecture or tensor type -> UnsupportedModelError.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from kvledger.errors import ConfigError, InvalidParameterError, ModelNotFoundError
from kvledger.model.families import (
    check_runnable,
    family_of,
    spec_from_gguf_reader,
    spec_from_hf_config,
)
from kvledger.model.weights import LOAD_FORMATS
from kvledger.model.weights.names import tensor_shapes, to_common_names
from kvledger.paths import cache_dir, resolve_model_path
from kvledger.spec import ModelSpec

CACHE_VERSION = "kvledger-weights-v6"  # v3: o_bias / mlp_bias; v4: the families' fields;
# v5: experts (mlp_only_layers, norm_topk_prob); v6: state layers (state_*, mamba_*)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
_MIB = 1 << 20


def file_key(path: Path, purpose: str = CACHE_VERSION) -> str:
    """Cache key of a model file: sha256 of (purpose, size, mtime_ns, first and last MiB), hex."""
    stat = path.stat()
    digest = hashlib.sha256(f"{purpose}:{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with open(path, "rb") as f:
        digest.update(f.read(_MIB))
        f.seek(max(0, stat.st_size - _MIB))
        digest.update(f.read(_MIB))
    return digest.hexdigest()


def load_weights(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, load_format: str = "auto"
) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Load a model's spec and HF-named weights (contiguous tensors of ``dtype`` on the CPU).

    Args:
        path: a GGUF file, a Hugging Face folder, or ``"default"`` (the bundled model); with
            ``load_format="dummy"`` also a catalogue id (:func:`.dummy.dummy_spec`).
        dtype: torch dtype of every returned tensor (e.g. torch.float32, torch.bfloat16).
        load_format: ``auto`` (the checkpoint) or ``dummy`` (:mod:`.dummy`).
    Raises:
        ModelNotFoundError, ConfigError, UnsupportedModelError: see the module docstring.
        InvalidParameterError: an unknown ``load_format``.
    """
    from kvledger.model.weights.dummy import dummy_spec, dummy_weights

    if load_format not in LOAD_FORMATS:
        raise InvalidParameterError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, "
                                    f"got {load_format!r}")
    if load_format == "dummy":
        spec = dummy_spec(str(path))
        check_runnable(spec)
        return spec, dummy_weights(spec, dtype, family_of(spec))
    path = resolve_model_path(path)
    if path.is_dir():
        spec, state = _load_hf_folder(path)
    elif (blocks := _load_gguf_blocks(path, dtype)) is not None:
        _check_complete(*blocks)
        return blocks
    else:
        spec, state = _load_gguf_cached(path, dtype)
    to_common_names(state, spec, family_of(spec))
    _check_complete(spec, state)
    cast = {name: _cast(t, dtype) for name, t in state.items()}
    if isinstance(state, MappedWeights):  # same dtype as cached: the same mapped tensors
        state.update(cast)
        return spec, state
    return spec, cast


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating tensors to ``dtype``; integer ones (packed 4-bit codes) unchanged."""
    return t.to(dtype).contiguous() if t.is_floating_point() else t.contiguous()


def _load_gguf_cached(path: Path, dtype: torch.dtype) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Spec and state dict of ``dtype`` from the cache, or dequantized (fp32 -> dtype) and cached.

    Cache hits are memory-mapped: a tensor's bytes are read from disk when first touched.
    """
    from safetensors import SafetensorError, safe_open

    from kvledger.spec import check_gguf_magic

    check_gguf_magic(path)
    dtype_name = str(dtype).removeprefix("torch.")
    cached = cache_dir() / "weights" / f"{file_key(path)}-{dtype_name}.safetensors"
    if cached.is_file():
        try:
            with safe_open(str(cached), framework="pt") as f:
                spec = _spec_from_json(f.metadata()["spec"], path)
                names = f.keys()
                return spec, MappedWeights({name: f.get_tensor(name) for name in names},
                                           cached)
        except (SafetensorError, OSError, KeyError, ValueError, TypeError):
            pass  # corrupt, truncated or stale (older ModelSpec) entry: rebuild it below
    spec, state = _load_gguf(path)
    state = {name: _cast(t, dtype) for name, t in state.items()}
    _save_atomically(state, {"spec": _spec_to_json(spec)}, cached)
    return spec, state


def _load_gguf_blocks(path: Path, dtype: torch.dtype
                      ) -> tuple[ModelSpec, dict[str, torch.Tensor]] | None:
    """Spec and tensors of a K-quant GGUF with its matrices held as the file's blocks
    (:func:`kvledger.model.weights.gguf_tensors.gguf_block_state`: read in seconds, so not
    cached); None for another GGUF."""
    from kvledger.model.weights.gguf_tensors import gguf_block_state, is_kquant_file
    from kvledger.spec import check_gguf_magic, open_gguf

    check_gguf_magic(path)
    reader = open_gguf(path)
    spec = spec_from_gguf_reader(reader, path)
    family = family_of(spec)
    if not is_kquant_file(reader, family):
        return None
    check_runnable(spec)  # before any block is read
    return spec, gguf_block_state(reader, path, spec, family, dtype)


class MappedWeights(dict):
    """A state dict whose tensors are views of a memory-mapped cache file.

    :meth:`release` hands a consumed tensor's pages back to the OS (``madvise(MADV_DONTNEED)``;
    a later read re-reads them from the file), so building the model's own formats layer by
    layer never holds the whole file in RAM. Only whole pages inside a mapping of that file are
    released, which /proc/self/maps confirms, so memory that is not this file is never touched.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], path: Path) -> None:
        super().__init__(tensors)
        self._ranges = _mapped_ranges(path)

    def release(self, tensor: torch.Tensor) -> None:
        """Return the pages of ``tensor`` (a value of this dict, no longer needed) to the OS."""
        page = mmap.PAGESIZE
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
        lo, hi = -(-start // page) * page, end // page * page
        if hi > lo and any(a <= lo and hi <= b for a, b in self._ranges) and _LIBC:
            _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED)


MADV_DONTNEED = 4  # Linux <sys/mman.h>
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of ``path`` (empty off Linux)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    target, ranges = str(path.resolve()), []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def _load_gguf(path: Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    from kvledger.model.weights.gguf_tensors import gguf_state_dict
    from kvledger.spec import open_gguf

    reader = open_gguf(path)
    spec = spec_from_gguf_reader(reader, path)
    check_runnable(spec)  # before dequantizing
    return spec, gguf_state_dict(reader, spec, family_of(spec))


def _save_atomically(
    state: dict[str, torch.Tensor], metadata: dict[str, str], target: Path
) -> None:
    """Write ``state`` as safetensors to ``target`` via a temp file + rename; a cache that
    cannot be written (read-only, disk full) is skipped, never an error."""
    from safetensors.torch import save_file

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
        os.close(fd)
        try:
            save_file(state, tmp, metadata=metadata)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        return


def _spec_to_json(spec: ModelSpec) -> str:
    return json.dumps(spec.as_fields())


def _spec_from_json(text: str, path: Path) -> ModelSpec:
    fields = json.loads(text)
    fields["layer_types"] = tuple(fields["layer_types"])
    fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
    fields["mlp_only_layers"] = tuple(fields["mlp_only_layers"])
    fields["state_recurrent_shape"] = tuple(fields["state_recurrent_shape"])
    fields["time_step_limit"] = tuple(fields.get("time_step_limit", (0.0, None)))
    fields["source"] = str(path)
    return ModelSpec.from_fields(**fields)


def _load_hf_folder(folder: Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"no config.json in {folder} (give a GGUF file or an HF folder)")
    shards = _safetensors_shards(folder)
    spec = spec_from_hf_config(folder / "config.json")
    check_runnable(spec)  # before any weight is read
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            state.update(load_file(str(shard)))
        except (SafetensorError, OSError) as exc:
            raise ConfigError(f"corrupt safetensors file {shard}: {exc}") from None
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return spec, state


def _safetensors_shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelNotFoundError(f"no *.safetensors weights in {folder}")
    return shards


def _check_complete(spec: ModelSpec, state: dict[str, torch.Tensor]) -> None:
    """Raise ConfigError naming the first tensor of :func:`.names.tensor_shapes` the state
    dict lacks, or holds at another shape."""
    for name, shape in tensor_shapes(spec, family_of(spec)).items():
        if name not in state:
            raise ConfigError(f"weights of {spec.source} lack the tensor {name!r}")
        if tuple(state[name].shape) != shape:
            raise ConfigError(f"{spec.source}: tensor {name!r} is {list(state[name].shape)}, "
                              f"the config says {list(shape)}")


def load_tokenizer(path: str | os.PathLike):
    """A transformers tokenizer (with chat template) for a GGUF file or an HF folder.

    Raises:
        ModelNotFoundError: unknown path.
        ConfigError: the file is not a GGUF, or no tokenizer can be built from it.
    """
    from transformers import AutoTokenizer

    path = resolve_model_path(path)
    if path.is_dir() and not any((path / n).is_file() for n in TOKENIZER_FILES):
        raise ConfigError(f"no tokenizer in {path} (expected one of {', '.join(TOKENIZER_FILES)})")
    try:
        if path.is_dir():
            return AutoTokenizer.from_pretrained(str(path))
        return _gguf_tokenizer(path, AutoTokenizer)
    except (OSError, ValueError, KeyError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"cannot load a tokenizer from {path}: {reason}") from e


def _gguf_tokenizer(path: Path, auto_tokenizer):
    from kvledger.spec import check_gguf_magic

    check_gguf_magic(path)
    cached = cache_dir() / "tokenizers" / file_key(path, purpose="kvledger-tokenizer-v1")
    if (cached / "tokenizer_config.json").is_file():
        return auto_tokenizer.from_pretrained(str(cached))
    try:
        tokenizer = auto_tokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError as refused:  # an architecture transformers' GGUF reader lacks
        from transformers import PreTrainedTokenizerFast

        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent),
                                                                gguf_file=path.name)
        except (OSError, ValueError, KeyError):
            raise refused from None
    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cached.parent, suffix=".tmp")
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:  # read-only cache or a concurrent writer won the rename: keep going
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def load_tokenizer_or_bundled(model: str):
    """(tokenizer, note) for dummy weights: the model's own (a GGUF's, or a folder's with a
    tokenizer file) and None, else the bundled model's and
    :data:`.dummy.BUNDLED_TOKENIZER_NOTE`."""
    from kvledger.model.weights.dummy import BUNDLED_TOKENIZER_NOTE

    path = Path(model).expanduser()
    if model == "default" or (path.is_file() and path.suffix == ".gguf"):
        return load_tokenizer(model), None
    folder = path if path.is_dir() else path.parent
    if path.exists() and any((folder / n).is_file() for n in TOKENIZER_FILES):
        return load_tokenizer(folder), None
    return load_tokenizer("default"), BUNDLED_TOKENIZER_NOTE
