"""What every rank of a launch needs, done once: the forkserver the ranks fork from imports this
module (``cli.main.WORKER_PRELOAD``), so no rank imports torch, transformers and the worker
again, or builds transformers' table of checkpoint conversions again (every model type's, each
with its regexes compiled: 0.3 s of CPU in every rank, for the final ``save_pretrained``).
Nothing here starts a thread or touches a device, so forking afterwards stays safe."""

import transformers.modeling_utils  # noqa: F401

import fsdp_turbo.cli.worker  # noqa: F401
from fsdp_turbo.core.hf import build_conversion_table

build_conversion_table()
