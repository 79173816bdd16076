"""EngineConfig: every knob of the engine; its docstring is also the help of the CLI options
(:mod:`kvledger.commands.engine_options`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.engine.kv.events.config import KVEventsConfig, parse_kv_events_config
from kvledger.engine.spec.config import SpeculativeConfig
from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv_format import KEY_QUANT_MODES, ROTATIONS, KVFormatSpec
from kvledger.ledger.retention import RetentionSpec, spec_from_options
from kvledger.model.weights import LOAD_FORMATS
from kvledger.ranges import Range, check_all

KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8", "int8", "int4", "int3", "int2")
_TOKENS = Range(1, 1 << 31, hi_open=True, optional=True)  # a count of tokens (or blocks)
_SECONDS = Range(0, 1 << 20, integer=False, lo_open=True)  # up to 12 days
_GIB = Range(0, 1 << 20, integer=False, lo_open=True, optional=True)
ENGINE_RANGES: dict[str, Range] = {
    "block_size": Range(1, 1 << 16),
    "kv_cache_gib": _GIB,
    "num_blocks": _TOKENS,
    "max_num_seqs": Range(1, 1 << 20),
    "max_num_batched_tokens": _TOKENS,
    "new_prefill_tokens": Range(0, 1 << 31, hi_open=True, optional=True),
    "state_checkpoint_blocks": _TOKENS,
    "long_prompt_tokens": _TOKENS,
    "long_kv_share": Range(0, 1, integer=False, lo_open=True),
    "max_kv_tokens_per_request": _TOKENS,
    "num_threads": Range(1, 1 << 12, optional=True),
    "kv_window": _TOKENS,
    "kv_sinks": Range(0, 1 << 31, hi_open=True, optional=True),
    "kv_budget": _TOKENS,
    "kv_group_size": Range(1, 1 << 16, optional=True),
    "kv_outlier_channels": Range(0, 1 << 16),
    "kv_key_group_tokens": _TOKENS,
    "kv_residual_tokens": _TOKENS,
    "kv_intact_tokens": Range(0, 1 << 31, hi_open=True, optional=True),
    "tensor_parallel_size": Range(1, 1 << 10),
    "tp_timeout_s": _SECONDS,
    "kv_disk_gib": _GIB,
    "kv_ram_gib": _GIB,
    "grammar_cache_mib": Range(1, 1 << 30, optional=True),
    "max_grammar_bytes": _TOKENS,
    "max_schema_properties": _TOKENS,
    "max_grammar_alternatives": _TOKENS,
}
"""The numeric fields' allowed ranges (``docs/validation.md``; the CLI checks its options by
the same table before a command runs: ``commands/option_ranges.py``)."""


@dataclass
class EngineConfig:
    """Engine construction options.

    Attributes:
        model: ``default`` (the bundled SmolLM2-135M-Instruct GGUF), a GGUF file, or a Hugging
            Face folder (config.json + safetensors).
        dtype: the activation (compute) dtype, also the KV pool's: ``bf16`` (the fast mode: each
            weight held in the format the kernel probe chose, e.g. the GGUF's Q4 kept packed)
            or ``fp32`` (every weight dense fp32: exact against transformers, for comparisons).
        block_size: tokens per KV block.
        kv_cache_gib: KV pool size in GiB, turned into whole blocks by the ledger.
        num_blocks: KV pool size in blocks; wins over kv_cache_gib. With neither, the pool
            holds max_num_seqs full-context sequences, capped at 1 GiB.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step, prefill chunks included.
        new_prefill_tokens: tokens of each step's budget that the running prefills leave to
            waiting requests while any wait, so a short prompt arriving behind a long one is
            admitted at the next step instead of after its last chunk; 0 = none, None = a
            quarter of max_num_batched_tokens. Less than max_num_batched_tokens.
        enable_prefix_caching: reuse full KV blocks across requests by the hash of their tokens.
        state_checkpoint_blocks: on a model with state layers, blocks between two checkpoints of
            a sequence's state (what its prefix hits start from); None = the ledger's
            (``checkpoint_interval_blocks``: the fewest blocks whose KV bytes reach the state's).
        long_prompt_tokens: prompts of at least this many tokens are long and share the pool
            under long_kv_share (seed §3.4 isolation); None = no isolation.
        long_kv_share: most share of the pool's blocks the long requests may hold together, in
            (0, 1].
        max_kv_tokens_per_request: per-request KV quota in tokens (prompt + max_tokens); None =
            no quota.
        use_kv_cache: keep the K and V of past tokens; without it every step recomputes the
            whole sequence (seed §1.3, for measuring).
        device: the device the engine computes on (cpu, cuda; ``kvledger.device.DEVICES``),
            resolved once per engine and by every tensor-parallel rank.
        num_threads: torch intra-op threads; None = the CPUs this process may use: the
            affinity mask capped by the cgroup CPU quota, rounded down
            (``device/cpu/cpu_quota.py``).
        attention: attention backend (reference, paged-torch or paged-native); None = the
            $KVLEDGER_ATTENTION environment variable or the kernel probe's choice.
        kv_policy: KV retention policy of every request that names none: full, window, sinks,
            h2o or snapkv (None = full).
        kv_window: recent tokens kept by window / sinks (and h2o's recent part).
        kv_sinks: first tokens always kept by sinks / h2o (default 4).
        kv_budget: most tokens kept by h2o, or a snapkv-compressed prompt.
        kv_positions: positions window / sinks attend at once tokens are dropped: original
            (each kept key where it was computed, kvpress's default) or cache (the held tokens
            at 0..n-1 in slot order, the query at n: StreamingLLM's scheme, llama.cpp's
            K-shift), None = cache (measured better past the context: BENCHMARKS.md).
        kv_select: how h2o / snapkv choose tokens: per-head (each layer and KV head keeps its
            own, the default) or per-sequence (one choice for all); None = the default.
        kv_scope: when window / sinks / h2o drop tokens: always (every step, the KV stays
            bounded; the default) or prompt (once, when the prompt is prefilled, then every
            later token is kept: kvpress's shape, like snapkv); None = always.
        kv_cache_dtype: KV format: auto (bf16, or fp32 when dtype is fp32), fp32, bf16, fp16,
            or the opt-in quantized fp8, int8, int4, int3, int2.
        kv_group_size: int8/int4 values (and per-token keys): elements per scale group along
            head_dim, dividing it; None = 32, or head_dim when 32 does not divide it.
        kv_key_quant: int8/int4 keys: per-channel (a scale per channel over a block's tokens,
            KIVI) or per-token (groups along head_dim, as values).
        kv_outlier_channels: key channels per layer and KV head kept in fp16 beside the
            quantized rest (quantized formats; chosen by the calibration).
        kv_rotation: none, or hadamard: quantized K and V rows rotated by a Hadamard matrix
            before quantization, queries and the attention output by the same (the bytes are
            unchanged; docs/kv-formats.md).
        kv_key_group_tokens: int keys per channel: tokens per key group (its scale and zero
            point), a multiple of block_size; None = 32 for int3 / int2 (one block with KV
            tiers or sliding layers), one block otherwise.
        kv_residual_tokens: quantized formats: the full-precision window of the most recent
            tokens per running sequence, a multiple of block_size, at least the key group;
            None = 128 for int4 / int3 / int2, the key group (one block) for fp8 / int8.
        kv_intact_tokens: quantized formats: the first tokens of every sequence (its
            attention sinks) kept at full precision and never quantized, rounded up to
            whole key groups (IntactKV); 0 = none; None = 32 for int4 / int3 / int2 (none
            with KV tiers or sliding layers), none for fp8 / int8.
        kv_calibration: calibration file written by kvledger calibrate (the outlier channels
            per layer and KV head); None = the file shipped with the bundled model.
        tensor_parallel_size: ranks the model is split over (Megatron-style: query heads,
            KV heads and the MLP per rank, the LM head by vocabulary); 1 = one process. More
            than 1 starts that many processes on torch.distributed (gloo on CPU), or joins
            the ranks torchrun started (RANK / WORLD_SIZE in the environment).
        tp_timeout_s: seconds a tensor-parallel collective may wait for a rank before the
            engine reports it failed (HTTP 503, /health unhealthy).
        load_format: auto (the model's weights) or dummy (vLLM's name: seeded random weights
            at the exact shapes of the model's config, which may be a catalogue id such as
            meta-llama/Llama-3.1-8B; refused when they and the KV pool exceed the available
            memory; the bundled tokenizer when the model has none, which the output says).
        kv_disk_dir: directory of the disk KV tier: full prefix-cache blocks are written there
            and loaded back when the pool has lost them, also after a restart (created with
            its parents; one server per directory); None = no disk tier. See docs/kv-tiers.md.
        kv_disk_gib: most GiB of block files the disk tier keeps (least recently used evicted
            first); None = 10 with kv_disk_dir.
        kv_ram_gib: a host-RAM KV tier of this many GiB between the pool and the disk tier
            (evicted pool blocks kept in memory); None = none.
        grammar_cache_mib: MiB the compiled structured-output constraints may hold in their
            cache (least recently used of the tenant holding most evicted first); None = 1/64
            of the RAM, at most 1024.
        max_grammar_bytes: largest structured-output constraint (its schema as JSON, regex,
            grammar or choices) in bytes; larger: HTTP 400.
        max_schema_properties: most properties a JSON schema constraint declares (all objects
            together); more: HTTP 400.
        max_grammar_alternatives: most alternatives of a constraint (choices, or a schema's
            enum values and anyOf / oneOf branches, all together); more: HTTP 400.
        kv_events_config: KV cache events for KV-aware routers, as vLLM's JSON object
            (enable_kv_cache_events, publisher, endpoint, replay_endpoint, topic, buffer_steps,
            hwm, max_queue_size; ours: encoding map or array); None = none. See docs/fleet.md.
        speculative_config: speculative decoding as vLLM spells it, a JSON object (a dict in
            Python): method (ngram, suffix, draft_model, auto or off), num_speculative_tokens,
            prompt_lookup_min, prompt_lookup_max, suffix_decoding_max_cached_requests, gate,
            model (the draft of draft_model); None = off. See docs/speculative.md.

    Raises:
        InvalidParameterError: a size or share out of range, a bad retention policy.
    """

    model: str = "default"
    dtype: str = "bf16"
    block_size: int = 16
    kv_cache_gib: float | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    new_prefill_tokens: int | None = None
    enable_prefix_caching: bool = True
    state_checkpoint_blocks: int | None = None
    long_prompt_tokens: int | None = None
    long_kv_share: float = 1.0
    max_kv_tokens_per_request: int | None = None
    use_kv_cache: bool = True
    device: str = "cpu"
    num_threads: int | None = None
    attention: str | None = None
    kv_policy: str | None = None
    kv_window: int | None = None
    kv_sinks: int | None = None
    kv_budget: int | None = None
    kv_positions: str | None = None
    kv_select: str | None = None
    kv_scope: str | None = None
    kv_cache_dtype: str = "auto"
    kv_group_size: int | None = None
    kv_key_quant: str = "per-channel"
    kv_outlier_channels: int = 0
    kv_rotation: str = "none"
    kv_key_group_tokens: int | None = None
    kv_residual_tokens: int | None = None
    kv_intact_tokens: int | None = None
    kv_calibration: str | None = None
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 60.0
    load_format: str = "auto"
    kv_disk_dir: str | None = None
    kv_disk_gib: float | None = None
    kv_ram_gib: float | None = None
    grammar_cache_mib: int | None = None
    max_grammar_bytes: int = 512 << 10
    max_schema_properties: int = 1000
    max_grammar_alternatives: int = 10_000
    kv_events_config: str | None = None
    speculative_config: str | dict | None = None

    def __post_init__(self) -> None:
        check_all(ENGINE_RANGES, {name: getattr(self, name) for name in ENGINE_RANGES})
        if self.new_prefill_tokens is not None and \
                self.new_prefill_tokens >= self.max_num_batched_tokens:
            raise InvalidParameterError(
                f"new_prefill_tokens ({self.new_prefill_tokens}) must be less than "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidParameterError(f"kv_cache_dtype must be one of "
                                        f"{', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_key_quant not in KEY_QUANT_MODES:
            raise InvalidParameterError(f"kv_key_quant must be one of "
                                        f"{', '.join(KEY_QUANT_MODES)}, got {self.kv_key_quant!r}")
        if self.kv_rotation not in ROTATIONS:
            raise InvalidParameterError(f"kv_rotation must be one of {', '.join(ROTATIONS)}, "
                                        f"got {self.kv_rotation!r}")
        if self.load_format not in LOAD_FORMATS:
            raise InvalidParameterError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                                        f"got {self.load_format!r}")
        if self.kv_disk_gib is not None and self.kv_disk_dir is None:
            raise InvalidParameterError("kv_disk_gib needs kv_disk_dir (--kv-disk-dir DIR)")
        self.retention  # noqa: B018 - validates the kv_* options
        self.kv_events  # noqa: B018 - validates kv_events_config
        if self.speculative.enabled and self.tensor_parallel_size > 1:
            raise InvalidParameterError(
                "speculative_config does not run with tensor parallelism yet "
                "(--tensor-parallel-size > 1): drop one of them")
        if self.speculative.enabled and not self.use_kv_cache:
            raise InvalidParameterError(
                "speculative_config verifies proposals against the KV cache, which was turned "
                "off (--no-kv-cache): drop one of them")

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """The parsed ``kv_events_config`` when it publishes events, else None."""
        if self.kv_events_config is None:
            return None
        config = parse_kv_events_config(self.kv_events_config)
        return config if config.publishes else None

    @property
    def prefill_reserve(self) -> int:
        """``new_prefill_tokens`` resolved: the budget running prefills leave to waiting
        requests."""
        if self.new_prefill_tokens is None:
            return self.max_num_batched_tokens // 4
        return self.new_prefill_tokens

    @property
    def speculative(self) -> SpeculativeConfig:
        """The checked ``speculative_config`` (``engine/spec/config.py``)."""
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def retention(self) -> RetentionSpec:
        """The default retention policy of the kv_* options (``ledger/retention.py``)."""
        return spec_from_options(self.kv_policy, self.kv_window, self.kv_sinks, self.kv_budget,
                                 self.kv_positions, self.kv_select, self.kv_scope)

    def kv_format_spec(self, compute_format: str | None = None) -> KVFormatSpec:
        """The KV format of the kv_* options; ``auto`` is ``compute_format`` (None: ``dtype``,
        the activations' format)."""
        return KVFormatSpec.from_options(self.kv_cache_dtype, compute_format or self.dtype,
                                         self.kv_group_size, self.kv_key_quant,
                                         self.kv_outlier_channels,
                                         residual_tokens=self.kv_residual_tokens,
                                         rotation=self.kv_rotation,
                                         key_group_tokens=self.kv_key_group_tokens,
                                         intact_tokens=self.kv_intact_tokens)
