"""turbo-quant: FSDPTurbo's MX block quantization and quantized training.

The MX formats, MXLinear and the converter framework land here (issue 5); this
release ships the package skeleton only.
"""

__version__ = "0.1.0"
