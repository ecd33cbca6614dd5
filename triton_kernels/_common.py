"""What the Triton kernels share: products and casts that give the GPU's
result under Triton's interpreter too (the tests run the kernels there, on
CPUs), and the product precision for an input dtype.

EMULATE_BF16 is True only for bfloat16 inputs under the interpreter; on GPUs
it is False and both helpers compile to the plain operation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from resident_trainer._ext import triton_interpreted


def emulate_bf16(t: torch.Tensor) -> bool:
    """The EMULATE_BF16 flag for a kernel whose inputs have t's dtype."""
    return t.dtype == torch.bfloat16 and (t.device.type != "cuda" or triton_interpreted())


def dot_precision(dtype: torch.dtype) -> str:
    """input_precision of tl.dot: fp32 inputs follow torch's own matmul
    setting (exact fp32 unless the caller allowed TF32 with
    torch.set_float32_matmul_precision); 16-bit inputs ignore it."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """acc + a @ b, accumulated in fp32."""
    if EMULATE_BF16:
        # The interpreter multiplies bfloat16 bit patterns as integers in
        # tl.dot (create_dot has no bf16 case; triton-lang/triton#11584,
        # "not supported yet", 2026-09). Products of bf16 values are exact in
        # fp32, so upcasting first gives the tensor cores' result.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def cast(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """x.to(dtype), rounding to nearest even as the GPU's cvt.rn does."""
    if EMULATE_BF16:
        # The interpreter's fp32 -> bf16 conversion drops the low 16 bits
        # (triton/runtime/interpreter.py, _convert_float): half of all casts
        # came out one ulp toward zero, doubling the rounding error.
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(dtype, bitcast=True)
    return x.to(dtype)
