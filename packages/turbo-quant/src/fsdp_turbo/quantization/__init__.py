"""turbo-quant: MX block quantization (E4M3, E5M2, HIF8), MX training and model converters.

- ``mx_formats``: ``quantize_mx`` / ``dequantize_mx``, ``hif8_encode`` / ``hif8_decode``;
- ``training``: ``MXLinear`` and MX fused MoE experts;
- ``converter``: ``convert_model(model, QuantizeConfig(...))`` and the converter registry;
- ``ops``: device backends (Triton and ``torch._scaled_mm`` on CUDA, torch_npu on NPU),
  registered lazily here: nothing is imported for a device until one of its ops runs.
"""

from fsdp_turbo.quantization.ops import register_backends

__version__ = "0.1.0"

register_backends()
