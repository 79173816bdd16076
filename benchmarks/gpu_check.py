"""The CUDA device's one prepared GPU check (issue 57): its Triton kernels against the torch
references at a Llama-3.1-8B layer's shapes, then their times, then the engine on the CUDA
device (``gpu_model_check.py``: greedy tokens against the CPU fp32 engine, whole-model TPOT,
batch-64 against transformers, the ledger's bytes against the allocator), meant to take under
5 minutes on an H100/H200, installing nothing (it needs the project's own environment with a
CUDA build of torch, triton and transformers).

1. Checks: paged attention (GQA 32/8, head 128, block 16; plain, window, sinks, soft-cap,
   split-KV; over int8 / int4 / fp8 pools) against gather + the reference backend's attention,
   fp32 within 1e-4 and bf16 within bf16 rounding; the int8 / int4 / int2 / fp8 KV encoders against
   ``engine/kv/codecs.py`` byte for byte, their decoders to fp32 tolerance.
2. Times (CUDA events): device-to-device copy bandwidth (the HBM figure); one layer's decode
   attention over a bf16 pool at contexts 1K / 8K / 32K for batch 1 and 16, with the K/V bytes
   it reads, their floor at the copy bandwidth and the GB/s reached; the KV encoders' and
   decoders' GB/s over 4,096 blocks.

3. The model half (``gpu_model_check.py``'s docstring): the greedy model is ``--model``
   (default: the bundled SmolLM2-135M-Instruct), the TPOT model a Llama-3.1-8B-shaped dummy.

Figures that exist: none from a GPU yet. Every check and time has run only as ``--dry-run``
(Triton's interpreter on CPU tensors, the CUDA device's test mode, tiny shapes and a tiny
random Llama for every model: the flow, not a measurement).

Usage: python benchmarks/gpu_check.py [--dry-run] [--repeat 20] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from functools import partial

import torch

# a Llama-3.1-8B layer: 32 query heads, 8 KV heads, head 128; the engine's block of 16 tokens
FULL = {"heads": 32, "kv_heads": 8, "dim": 128, "block": 16, "contexts": (1024, 8192, 32768),
        "batches": (1, 16), "codec_blocks": 4096}
TINY = {"heads": 4, "kv_heads": 2, "dim": 16, "block": 4, "contexts": (8, 24),
        "batches": (1, 2), "codec_blocks": 4}


def _device(dry_run: bool) -> str:
    if dry_run:
        return "cpu"
    if not torch.cuda.is_available():
        print(f"error: torch {torch.__version__} sees no CUDA GPU (use --dry-run here)",
              file=sys.stderr)
        raise SystemExit(2)
    return "cuda"


def _pool(shape: dict, context: int, batch: int, dtype, dev: str):
    """A pool of ``batch`` sequences of ``context`` tokens, block tables shuffled."""
    bs, per = shape["block"], -(-context // shape["block"])
    blocks = per * batch
    keys = torch.randn(blocks, bs, shape["kv_heads"], shape["dim"], dtype=dtype, device=dev)
    values = torch.randn_like(keys)
    tables = torch.randperm(blocks, device=dev).to(torch.int32).reshape(batch, per)
    q = torch.randn(batch, shape["heads"], shape["dim"], dtype=dtype, device=dev)
    seqs = torch.arange(batch, dtype=torch.int32, device=dev)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    return q, keys, values, tables, seqs, lens


def _oracle(q, keys, values, tables, lens, how):
    from kvledger.engine.attention.reference import _attend

    out = []
    for i in range(q.shape[0]):
        n = int(lens[i])
        k = keys[tables[i].long()].flatten(0, 1)[:n].transpose(0, 1)[None].float()
        v = values[tables[i].long()].flatten(0, 1)[:n].transpose(0, 1)[None].float()
        mask = None if how.window is None else (
            torch.arange(n, device=q.device) >= n - how.window)[None, None, None, :]
        out.append(_attend(q[i][None, :, None].float(), k, v, mask, False, how)[0, :, 0])
    return torch.stack(out)


def check_attention(shape: dict, dev: str) -> list[str]:
    """Paged attention against the reference, one line per case."""
    from kvledger.device.cuda.triton_kernels.paged_attention import paged_attention
    from kvledger.engine.attention.layer import LayerAttention

    scale = shape["dim"] ** -0.5
    sinks = torch.linspace(-1, 2, shape["heads"], device=dev)
    cases = {"plain": LayerAttention(scale), "window": LayerAttention(scale, window=5),
             "sinks": LayerAttention(scale, sinks=sinks),
             "soft-cap": LayerAttention(scale, softcap=3.0)}
    lines = []
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        for name, how in cases.items():
            for splits in (1, 3):
                q, keys, values, tables, seqs, lens = _pool(shape, shape["contexts"][-1], 2,
                                                            dtype, dev)
                got = paged_attention(q, keys, values, tables, seqs, lens, how.scale, how.window,
                                      how.softcap, how.sinks, splits)
                err = float((got.float() - _oracle(q, keys, values, tables, lens, how)).abs()
                            .max())
                verdict = "ok" if err <= tol else "FAIL"
                lines.append(f"{verdict} attention {name} {str(dtype)[6:]} splits={splits}: "
                             f"max |err| {err:.2e} (<= {tol:g})")
    lines += _check_quantized_attention(shape, dev)
    return lines


def _check_quantized_attention(shape: dict, dev: str) -> list[str]:
    """Paged attention over int8 / int4 / fp8 pools against the decoded pool's reference."""
    from kvledger.device.cuda.triton_kernels.paged_attention import (
        QuantizedSide,
        paged_attention_quantized,
    )
    from kvledger.engine.attention.layer import LayerAttention
    from kvledger.engine.kv.codec_numbers import codec_numbers
    from kvledger.engine.kv.codecs import Fp8Codec, IntCodec

    bs, heads, dim = shape["block"], shape["kv_heads"], shape["dim"]
    how = LayerAttention(dim ** -0.5)
    # encoded by the PyTorch codecs on the CPU: the shortest context keeps that quick
    q, keys, values, tables, seqs, lens = _pool(shape, shape["contexts"][0], 2, torch.float32,
                                                "cpu")
    lines = []
    for name, codecs in (("int8", [IntCodec(bs, heads, dim, 8, "per-channel", dim),
                                   IntCodec(bs, heads, dim, 8, "per-token", 8)]),
                         ("int4", [IntCodec(bs, heads, dim, 4, "per-channel", dim),
                                   IntCodec(bs, heads, dim, 4, "per-token", 8)]),
                         ("fp8", [Fp8Codec(bs, heads, dim)] * 2)):
        sides, decoded = [], []
        for codec, blocks in zip(codecs, (keys, values)):
            parts = codec.encode(blocks)
            decoded.append(codec.decode(parts, torch.float32))
            n = codec_numbers(codec)
            fields = [None if parts.get(f) is None else parts[f].to(dev)
                      for f in ("codes", "scale", "zero")]
            sides.append(QuantizedSide(n.kind, n.bits, n.group, *fields,
                                       torch.zeros(1, bs, heads, dim, device=dev)))
        none = torch.full((keys.shape[0],), -1, dtype=torch.int64, device=dev)
        got = paged_attention_quantized(q.to(dev), *sides, none, bs, tables.to(dev),
                                        seqs.to(dev), lens.to(dev), how.scale, splits=3)
        err = float((got.cpu() - _oracle(q, *decoded, tables, lens, how)).abs().max())
        lines.append(f"{'ok' if err <= 1e-4 else 'FAIL'} attention over an {name} pool: "
                     f"max |err| {err:.2e} (<= 0.0001)")
    return lines


def check_codecs(shape: dict, dev: str) -> list[str]:
    """The KV encoders byte for byte and the decoders to fp32 tolerance, one line each."""
    from kvledger.device.cuda.triton_kernels import kv_fp8, kv_int
    from kvledger.engine.kv.codecs import MIN_SCALE, Fp8Codec, IntCodec

    bs, heads, dim = shape["block"], shape["kv_heads"], shape["dim"]
    x = torch.randn(8, bs, heads, dim) * 3
    ids = torch.arange(8, device=dev)
    lines = []
    for bits, axis, group in ((8, "per-channel", 0), (4, "per-channel", 0), (4, "per-token", 8),
                              (2, "per-token", 8)):
        codec = IntCodec(bs, heads, dim, bits, axis, group or dim)
        parts = {k: torch.zeros((8, *s), dtype=t, device=dev)
                 for k, (s, t) in codec.fields().items()}
        kv_int.encode_into(x.to(dev), parts, ids, bits=bits, group=group, centred=False,
                           min_scale=MIN_SCALE)
        want = codec.encode(x)
        same = all(torch.equal(parts[k].cpu(), want[k]) for k in want)
        back = kv_int.decode(parts, torch.float32, bits=bits, group=group).cpu()
        err = float((back - codec.decode(want, torch.float32)).abs().max())
        lines.append(f"{'ok' if same and err <= 1e-5 else 'FAIL'} int{bits} {axis}: bytes "
                     f"{'equal' if same else 'DIFFER'}, decode max |err| {err:.1e}")
    codec = Fp8Codec(bs, heads, dim)
    parts = {k: torch.zeros((8, *s), dtype=t, device=dev) for k, (s, t) in codec.fields().items()}
    kv_fp8.encode_into(x.to(dev), parts, ids, min_scale=MIN_SCALE)
    want = codec.encode(x)
    same = all(torch.equal(parts[k].cpu(), want[k]) for k in want)
    lines.append(f"{'ok' if same else 'FAIL'} fp8: bytes {'equal' if same else 'DIFFER'}")
    return lines


def _ms(fn, dev: str, repeat: int) -> float:
    """Mean ms of ``fn()`` after one warm-up call (CUDA events on a GPU)."""
    fn()
    if dev != "cuda":
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - start) * 1e3 / repeat
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / repeat


def copy_bandwidth(dev: str, repeat: int) -> float:
    """GB/s of a device-to-device copy of 1 GiB (64 KiB in a dry run), read + write."""
    src = torch.empty(1 << (30 if dev == "cuda" else 16), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() / _ms(lambda: dst.copy_(src), dev, repeat) / 1e6


def measure(shape: dict, dev: str, repeat: int, copy_gbs: float) -> list[str]:
    """Decode attention per context and batch, codec throughput."""
    from kvledger.device.cuda.triton_kernels import kv_int
    from kvledger.device.cuda.triton_kernels.paged_attention import choose_splits, paged_attention

    units = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 4
    lines = [f"copy bandwidth: {copy_gbs:.0f} GB/s (read + write)"]
    for context in shape["contexts"]:
        for batch in shape["batches"]:
            q, keys, values, tables, seqs, lens = _pool(shape, context, batch, torch.bfloat16,
                                                        dev)
            splits = choose_splits(batch, shape["kv_heads"], tables.shape[1], units)
            ms = _ms(partial(paged_attention, q, keys, values, tables, seqs, lens,
                             shape["dim"] ** -0.5, splits=splits), dev, repeat)
            kv_bytes = 2 * batch * context * shape["kv_heads"] * shape["dim"] * 2  # K+V, bf16
            floor = kv_bytes / copy_gbs / 1e6
            lines.append(f"decode attention, one layer, bf16, context {context}, batch {batch} "
                         f"({splits} splits): {ms:.3f} ms; K/V {kv_bytes / 1e6:.1f} MB, "
                         f"floor {floor:.3f} ms, {kv_bytes / ms / 1e6:.0f} GB/s")
    blocks = torch.randn(shape["codec_blocks"], shape["block"], shape["kv_heads"], shape["dim"],
                         dtype=torch.bfloat16, device=dev)
    ids = torch.arange(blocks.shape[0], device=dev)
    for bits in (8, 4):
        width = shape["dim"] * bits // 8
        parts = {"codes": torch.empty(*blocks.shape[:3], width, dtype=torch.uint8, device=dev),
                 "scale": torch.empty(blocks.shape[0], shape["kv_heads"], shape["dim"],
                                      dtype=torch.float16, device=dev)}
        parts["zero"] = torch.empty_like(parts["scale"])
        ms = _ms(partial(kv_int.encode_into, blocks, parts, ids, bits=bits, group=0,
                         centred=False, min_scale=2.0 ** -14), dev, repeat)
        dec = _ms(partial(kv_int.decode, parts, torch.bfloat16, bits=bits, group=0), dev, repeat)
        gb = blocks.numel() * blocks.element_size() / 1e6
        lines.append(f"int{bits} per-channel KV over {blocks.shape[0]} blocks: encode "
                     f"{gb / ms:.0f} GB/s, decode {gb / dec:.0f} GB/s (of bf16 K/V)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="the whole flow on CPU tensors under Triton's interpreter, tiny "
                             "shapes (its times are no measurement)")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per figure")
    parser.add_argument("--model", default="default",
                        help="the model of the greedy-token check (default: the bundled one)")
    args = parser.parse_args()
    if args.dry_run:  # the CUDA device's test mode, before any kernel is defined
        os.environ.update(TRITON_INTERPRET="1", KVLEDGER_CUDA_ON_CPU="1")
    dev = _device(args.dry_run)
    shape = TINY if args.dry_run else FULL
    where = (f"{torch.cuda.get_device_name()} · torch {torch.__version__}" if dev == "cuda"
             else f"dry run: Triton's interpreter on the CPU · torch {torch.__version__}")
    print(f"# gpu_check · {where}")
    checks = check_attention(shape, dev) + check_codecs(shape, dev)
    print("\n".join(checks), flush=True)
    import gpu_model_check as model_check

    with tempfile.TemporaryDirectory() as tmp:
        tiny = model_check.tiny_llama(tmp) if args.dry_run else None
        model_lines = model_check.check_greedy(tiny or args.model, model_check.TINY
                                               if args.dry_run else model_check.FULL)
        print("\n".join(model_lines), flush=True)
        checks += [line for line in model_lines if not line.startswith("info")]
        label = " (dry run: the flow, not a measurement)" if args.dry_run else ""
        print(f"# times{label}")
        repeat = 1 if args.dry_run else args.repeat
        copy_gbs = copy_bandwidth(dev, repeat)
        print("\n".join(measure(shape, dev, repeat, copy_gbs)), flush=True)
        model_shape = model_check.TINY if args.dry_run else model_check.FULL
        print("\n".join(model_check.measure_model(tiny or model_shape["tpot_model"],
                                                   model_shape, copy_gbs, dev)))
    failed = [line for line in checks if not line.startswith("ok")]
    if failed:
        print(f"error: {len(failed)} check(s) failed", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
