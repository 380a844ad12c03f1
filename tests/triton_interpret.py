"""Triton's CPU interpreter made to round like the GPU, for kernel tests under TRITON_INTERPRET=1.

Triton 3.6's interpreter converts float32 to bfloat16 by truncation and to float8 with a rounding that misses
ties and mantissa carries; compiled for the GPU the same casts round to nearest even (cvt.rn). Its tl.dot
multiplies bfloat16 operands as their raw 16-bit patterns (integers). `patch_casts()` routes the interpreter's
float conversions through torch's, which round to nearest even, and widens bfloat16 dot operands to float32
(exact), so a bit-exactness test passes under the interpreter exactly when it should on the device."""

from __future__ import annotations

import numpy as np
import torch


def patch_casts() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_parity_casts_patched", False):
        return
    torch_of = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16,
                tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    int_of = {8: (np.uint8, torch.uint8), 16: (np.int16, torch.int16), 32: (np.int32, torch.int32)}
    original = interpreter._convert_float

    def convert(data, src_dtype, dst_dtype, rounding_mode):
        if src_dtype not in torch_of or dst_dtype not in torch_of or rounding_mode not in (None, getattr(
                interpreter._ir.ROUNDING_MODE, "RTNE", None)):
            return original(data, src_dtype, dst_dtype, rounding_mode)
        arr = np.array(data, copy=True)
        src_np, src_int = int_of[src_dtype.primitive_bitwidth]
        dst_np, dst_int = int_of[dst_dtype.primitive_bitwidth]
        t = torch.from_numpy(arr.reshape(-1).view(src_np)).view(torch_of[src_dtype])
        out = t.to(torch_of[dst_dtype]).view(dst_int).numpy().reshape(arr.shape)
        return out.view(np.uint8 if dst_dtype.primitive_bitwidth == 8 else out.dtype)

    interpreter._convert_float = convert
    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = interpreter.TensorHandle(convert(a.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = interpreter.TensorHandle(convert(b.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot
    interpreter._parity_casts_patched = True
