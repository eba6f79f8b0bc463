"""Chunked batch: chosen modules run their forward in batch slices, to cut its activation peak."""

from fsdp_turbo.memory.chunk_batch.apply import apply_chunk_batch, is_chunked
from fsdp_turbo.memory.chunk_batch.transform import ChunkBatchTransform

__all__ = ["ChunkBatchTransform", "apply_chunk_batch", "is_chunked"]
