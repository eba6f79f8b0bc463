"""MX block formats: E8M0-scaled blocks of E4M3, E5M2 or HIF8 (HiFloat8) elements.

    mx = quantize_mx(x, "E4M3", block_size=32, scale_mode="floor")   # -> MXTensor
    y = dequantize_mx(mx, torch.bfloat16)

Modules: ``formats`` (the format table), ``e8m0`` (block scales and their policies),
``fp8`` (E4M3 / E5M2 codes), ``hif8`` (HiF8 codes), ``mx_tensor`` (the quantizer),
``reference`` (slow, straightforward implementations that the tests and the bench
compare against). The kernels are registered in ``fsdp_turbo.core.ops`` as
``mx.quantize``, ``mx.dequantize``, ``hif8.encode`` and ``hif8.decode``.
"""

from fsdp_turbo.quantization.mx_formats.e8m0 import E8M0_BIAS, E8M0_NAN, e8m0_to_float32
from fsdp_turbo.quantization.mx_formats.formats import FORMATS, MXFormat, get_format
from fsdp_turbo.quantization.mx_formats.fp8 import fp8_decode, fp8_encode
from fsdp_turbo.quantization.mx_formats.hif8 import (
    HIF8_MAX,
    HIF8_MIN_DENORMAL,
    HIF8_MIN_NORMAL,
    HIF8_NAN,
    HIF8_NEG_INF,
    HIF8_POS_INF,
    hif8_decode,
    hif8_encode,
)
from fsdp_turbo.quantization.mx_formats.mx_tensor import MXTensor, dequantize_mx, quantize_mx

__all__ = [
    "E8M0_BIAS",
    "E8M0_NAN",
    "FORMATS",
    "HIF8_MAX",
    "HIF8_MIN_DENORMAL",
    "HIF8_MIN_NORMAL",
    "HIF8_NAN",
    "HIF8_NEG_INF",
    "HIF8_POS_INF",
    "MXFormat",
    "MXTensor",
    "dequantize_mx",
    "e8m0_to_float32",
    "fp8_decode",
    "fp8_encode",
    "get_format",
    "hif8_decode",
    "hif8_encode",
    "quantize_mx",
]
