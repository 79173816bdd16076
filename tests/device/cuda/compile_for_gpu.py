"""Compile every Triton kernel of the CUDA device for an H100 (sm_90) on a machine without a
GPU: Triton lowers it to PTX and its bundled ptxas assembles a cubin, so what the interpreter
does not check (types, layouts, the lowering of every op) is checked here. Run by
``test_triton_compile.py`` in a process without ``TRITON_INTERPRET``; prints one line per
kernel variant."""

from __future__ import annotations

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvledger.device.cuda.triton_kernels import kv_fp8, kv_int, linear_int8, paged_attention

H100 = GPUTarget("cuda", 90, 32)
I32 = "i32"


def _attention(kind: int, softcap: bool):
    scale_t = "*fp32" if kind == 2 else "*fp16"
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "k_codes": "*u8", "k_scale": scale_t,
           "k_zero": "*fp16", "k_res": "*bf16", "v_ptr": "*bf16", "v_codes": "*u8",
           "v_scale": scale_t, "v_zero": "*fp16", "v_res": "*bf16", "residual_of": "*i64",
           "tables_ptr": "*i32", "seq_ptr": "*i32", "lens_ptr": "*i32", "m_ptr": "*fp32",
           "l_ptr": "*fp32", "acc_ptr": "*fp32", "scale": "fp32", "softcap": "fp32"}
    sig |= dict.fromkeys(("window", "blocks_per_split", "splits", "stride_qn", "stride_qh",
                          "stride_kb", "stride_kt", "stride_kh", "stride_tab"), I32)
    consts = {"HEADS": 32, "H": 8, "GP": 4, "D": 128, "DP": 128, "BS": 16, "BSP": 16,
              "SOFTCAP": softcap, "KIND": kind, "K_BITS": 4 if kind == 1 else 8, "K_GROUP": 0,
              "V_BITS": 4 if kind == 1 else 8, "V_GROUP": 32 if kind == 1 else 0}
    return paged_attention._split_kernel, sig, consts, True


def _merge():
    sig = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "sinks_ptr": "*fp32",
           "out_ptr": "*bf16", "stride_on": I32, "stride_oh": I32, "splits": I32}
    return (paged_attention._merge_kernel, sig,
            {"HEADS": 32, "D": 128, "DP": 128, "SP": 8, "HAS_SINKS": True}, True)


def _int(encode: bool, bits: int, group: int):
    if encode:
        sig = {"x_ptr": "*bf16", "ids_ptr": "*i64", "codes_ptr": "*u8", "scale_ptr": "*fp16",
               "zero_ptr": "*fp16", "min_scale": "fp32", "stride_xn": I32, "stride_xt": I32,
               "stride_xh": I32}
        consts = {"H": 8, "BS": 16, "D": 128, "BITS": bits, "GROUP": group, "CENTRED": 0}
        return kv_int._encode_kernel, sig, consts, False
    sig = {"codes_ptr": "*u8", "scale_ptr": "*fp16", "zero_ptr": "*fp16", "out_ptr": "*bf16"}
    return (kv_int._decode_kernel, sig,
            {"H": 8, "BS": 16, "D": 128, "BITS": bits, "GROUP": group}, False)


def _fp8(encode: bool):
    if encode:
        sig = {"x_ptr": "*bf16", "ids_ptr": "*i64", "codes_ptr": "*u8", "scale_ptr": "*fp32",
               "min_scale": "fp32", "stride_xn": I32, "stride_xt": I32, "stride_xh": I32}
        return kv_fp8._encode_kernel, sig, {"H": 8, "BS": 16, "D": 128}, False
    sig = {"codes_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": "*bf16"}
    return kv_fp8._decode_kernel, sig, {"H": 8, "BS": 16, "D": 128}, False


def _int8_product(block_m: int):
    sig = {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "y_ptr": "*bf16", "M": I32,
           "N": I32, "K": I32, "stride_xm": I32, "stride_qn": I32, "stride_ym": I32}
    return (linear_int8._kernel, sig, {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64},
            True)


VARIANTS = {
    "attention bf16": _attention(0, False), "attention bf16 soft-cap": _attention(0, True),
    "attention int4": _attention(1, False), "attention fp8": _attention(2, False),
    "attention merge": _merge(),
    **{f"int{b} {'encode' if e else 'decode'} group {g}": _int(e, b, g)
       for b in (8, 4, 2) for e in (True, False) for g in (0, 32)},
    "fp8 encode": _fp8(True), "fp8 decode": _fp8(False),
    "int8 weight product, decode tile": _int8_product(16),
    "int8 weight product, prefill tile": _int8_product(64),
}


def main() -> None:
    assert not os.environ.get("TRITON_INTERPRET"), "compiling needs the JIT, not the interpreter"
    failed = 0
    for name, (fn, sig, consts, fusion) in VARIANTS.items():
        sig = sig | dict.fromkeys(consts, "constexpr")
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                    target=H100, options={"enable_fp_fusion": fusion})
            print(f"ok {name}: {len(kernel.asm['cubin'])} bytes of sm_90 cubin")
        except Exception as exc:  # noqa: BLE001 - every kernel is tried and reported
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:300]}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
