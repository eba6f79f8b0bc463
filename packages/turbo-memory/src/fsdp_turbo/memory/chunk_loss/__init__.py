"""Chunked cross-entropy: the [tokens, vocab] logits are never materialised."""

from fsdp_turbo.memory.chunk_loss.function import chunked_cross_entropy
from fsdp_turbo.memory.chunk_loss.hf_head import ChunkedLossHandle, install_chunked_loss
from fsdp_turbo.memory.chunk_loss.transform import ChunkLossTransform

__all__ = ["ChunkLossTransform", "ChunkedLossHandle", "chunked_cross_entropy", "install_chunked_loss"]
