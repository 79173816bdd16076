"""The model half of ``gpu_check.py`` (issue 57), through the engine on the CUDA device: the
same ``LLMEngine`` a user runs with ``--device cuda`` (weights, KV pool, step metadata and
logits on the GPU; attention by our Triton kernels).

1. Greedy tokens against the CPU fp32 reference (the engine on the CPU in fp32): on the CUDA
   device in fp32 with a bf16-free pool (check: the same tokens), in fp32 over an int8 pool
   against the CPU's int8 pool (check: the same tokens), and in bf16 (how many leading tokens
   agree, reported, not checked: bf16 may flip a near tie).
2. TPOT of a Llama-3.1-8B-shaped dummy model (``--load-format dummy``) in bf16 with bf16, int8
   and int4 KV at contexts 1K / 8K / 32K (one request, prompt prefilled in one chunk, the
   median decode step), each beside its HBM floor: the weights a decode step reads plus the
   context's KV bytes (the ledger's), over the measured copy bandwidth.
3. Batch-64 decode throughput (64 requests decoding together) against transformers'
   ``generate`` of the same shapes on the same GPU (random weights; bf16).
4. The ledger's bytes (the model's weights and the KV pool, ``kvledger plan``'s figures)
   against the growth of ``torch.cuda.memory_allocated`` while the engine is built (the
   dummy weights drawn on the GPU for each engine, no other reference kept).

``--dry-run`` (``gpu_check.py``): the same flow on CPU tensors under Triton's interpreter
(the CUDA device's test mode), a tiny random Llama for every model, tiny contexts: the flow,
not a measurement.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch
from common import decode_step_times

from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.engine.sample.sampling_params import SamplingParams

FULL = {"tpot_model": "meta-llama/Llama-3.1-8B", "contexts": (1024, 8192, 32768), "steps": 16,
        "block": 16, "kv_gib": 8.0, "batch": 64, "batch_prompt": 512, "batch_new": 32,
        "greedy_steps": 16, "greedy_prompts": [list(range(3, 40)), list(range(60, 71))]}
TINY = {"contexts": (12,), "steps": 2, "block": 4, "kv_gib": 0.01, "batch": 3,
        "batch_prompt": 8, "batch_new": 3, "greedy_steps": 2,
        "greedy_prompts": [list(range(3, 14))]}
KV_FORMATS = ("bf16", "int8", "int4")


def tiny_llama(folder) -> str:
    """A random 2-layer Llama (GQA 4/2, head 16) saved by transformers in ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return str(folder)


def _free(*objects) -> None:
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _greedy(model: str, device: str, dtype: str, kv: str, prompts: list[list[int]],
            steps: int) -> list[list[int]]:
    from kvledger.engine.model_load import DTYPES
    from kvledger.model.weights.loader import load_weights

    spec, weights = load_weights(model, DTYPES[dtype])  # the prompts are ids: no tokenizer
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, device=device, kv_cache_dtype=kv,
                                    max_num_seqs=len(prompts)), spec=spec, weights=weights)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    _free(engine)
    return [done[f"g{i}"] for i in range(len(prompts))]


def check_greedy(model: str, shape: dict) -> list[str]:
    """Check lines (``ok`` / ``FAIL``) and one reported line: the CUDA device's greedy tokens
    against the CPU fp32 engine's."""
    prompts, steps = shape["greedy_prompts"], shape["greedy_steps"]
    lines, refs = [], {}
    for kv in ("auto", "int8"):
        refs[kv] = ref = _greedy(model, "cpu", "fp32", kv, prompts, steps)
        got = _greedy(model, "cuda", "fp32", kv, prompts, steps)
        lines.append(f"{'ok' if got == ref else 'FAIL'} greedy tokens, cuda fp32 vs cpu fp32, "
                     f"{'bf16-free' if kv == 'auto' else kv} pool: {got} vs {ref}")
    ref = refs["auto"]
    got = _greedy(model, "cuda", "bf16", "auto", prompts, steps)
    agree = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r))
             for g, r in zip(got, ref)]
    lines.append(f"info greedy tokens, cuda bf16 vs cpu fp32: leading tokens agree {agree} of "
                 f"{steps} (reported, not checked)")
    return lines


def _engine(model: str, shape: dict, kv: str, spec, dev: str, **options):
    """The engine on the CUDA device over fresh dummy weights drawn on ``dev`` (no other
    reference to them is kept: after the build, what the allocator holds is the model's)."""
    from kvledger.model.families import family_of
    from kvledger.model.weights.dummy import dummy_weights

    config = EngineConfig(model=model, dtype="bf16", device="cuda", kv_cache_dtype=kv,
                          load_format="dummy", block_size=shape["block"],
                          kv_cache_gib=shape["kv_gib"],
                          max_num_batched_tokens=1 + max(*shape["contexts"],
                                                         shape["batch"] * shape["batch_prompt"]),
                          **options)
    return LLMEngine(config, spec=spec, tokenizer=None,
                     weights=dummy_weights(spec, torch.bfloat16, family_of(spec), dev))


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _allocated(dev: str) -> int:
    gc.collect()
    return torch.cuda.memory_allocated() if dev == "cuda" else 0


def _ledger_line(engine, spec, kv: str, grew: int | None) -> str:
    """The ledger's weights (``kvledger plan``'s) and pool bytes beside the allocator's."""
    from kvledger.ledger.params import spec_weight_bytes

    weights, pool = spec_weight_bytes(spec, "bf16"), engine.store.nbytes
    held = ("n/a (dry run: no CUDA allocator)" if grew is None else
            f"{grew / 1e9:.3f} GB ({(grew - weights - pool) / 1e6:+.1f} MB)")
    return (f"ledger vs allocator, {kv} KV: weights {weights / 1e9:.3f} GB + KV pool "
            f"{pool / 1e9:.3f} GB ({engine.scheduler.kv.pool.num_blocks} blocks); "
            f"torch.cuda.memory_allocated grew {held}")


def measure_model(model: str, shape: dict, copy_gbs: float, dev: str) -> list[str]:
    """TPOT per KV format and context with its floor, the ledger's bytes against the
    allocator's, batch-64 throughput against transformers (module docstring, 2-4)."""
    from kvledger.model.weights.dummy import dummy_spec

    spec = dummy_spec(model)
    lines = []
    for kv in KV_FORMATS:
        base = _allocated(dev)
        engine = _engine(model, shape, kv, spec, dev, max_num_seqs=1)
        lines.append(_ledger_line(engine, spec, kv,
                                  _allocated(dev) - base if dev == "cuda" else None))
        for context in shape["contexts"]:
            params = SamplingParams(max_tokens=shape["steps"] + 1, temperature=0.0,
                                    ignore_eos=True)
            times = decode_step_times(engine, [_ids(context, spec.vocab_size, context)],
                                      [params])
            ms = statistics.median(times) * 1e3
            read = engine.model.decode_weight_bytes + context * engine.bytes_per_token
            floor = read / copy_gbs / 1e6
            lines.append(f"TPOT bf16 weights, {kv} KV, context {context}: {ms:.2f} ms "
                         f"(median of {len(times)}); HBM floor {floor:.2f} ms "
                         f"({read / 1e9:.2f} GB read), {100 * floor / ms:.0f}% of it")
        _free(engine)
    lines.append(_batch_line(model, shape, spec, dev))
    return lines


def _batch_line(model: str, shape: dict, spec, dev: str) -> str:
    """Batch decode throughput of the engine and of transformers' ``generate``."""
    n, prompt, new = shape["batch"], shape["batch_prompt"], shape["batch_new"]
    engine = _engine(model, shape, "bf16", spec, dev, max_num_seqs=n)
    prompts = [_ids(prompt, spec.vocab_size, i) for i in range(n)]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    times = decode_step_times(engine, prompts, [params] * n)
    ours = n / statistics.median(times)
    _free(engine)
    theirs = _transformers_batch(model, prompts, new, dev)
    return (f"batch-{n} decode, prompt {prompt}, bf16: {ours:.0f} tok/s; transformers "
            f"generate on the same device: {theirs:.0f} tok/s ({ours / theirs:.2f}x)")


def _transformers_batch(model: str, prompts: list[list[int]], new: int, dev: str) -> float:
    """Tokens per second of transformers' greedy ``generate`` decoding ``prompts`` together
    (random weights of ``model``'s config, bf16, SDPA): the decode steps' rate, from a
    one-token run subtracted from a ``new``-token run."""
    import transformers as tf

    from kvledger.model.catalogue import lookup

    config = tf.AutoConfig.from_pretrained(model if Path(model).is_dir() else lookup(model).path)
    with torch.device(dev):
        hf = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").eval()
    ids = torch.tensor(prompts, device=dev)

    def run(tokens: int) -> float:
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                        min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    run(2)  # warm-up
    decode_s = run(new) - run(1)
    _free(hf)
    return len(prompts) * (new - 1) / max(decode_s, 1e-9)
