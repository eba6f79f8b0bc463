"""chunk_batch: the same training as one call per batch, and a smaller forward peak."""

import logging

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.testing import make_token_batches, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo import FSDPTurbo
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
from fsdp_turbo.memory.chunk_batch import apply_chunk_batch, is_chunked
from fsdp_turbo.memory.chunk_batch.apply import join_batch, slice_batch
from fsdp_turbo.memory.recompute import apply_recompute

BATCHES = make_token_batches(vocab_size=256, global_batch=5, seq_len=16, steps=3)  # 5 rows: uneven slices


def _assert_close(reference, candidate):
    torch.testing.assert_close(torch.tensor(candidate.losses), torch.tensor(reference.losses), rtol=1e-6, atol=0)
    for name, grad in reference.grads.items():
        torch.testing.assert_close(candidate.grads[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("num_chunks, recompute", [(2, False), (3, False), (2, True), (8, False)])
def test_slices_train_as_one_call(kind, num_chunks, recompute):
    """3 AdamW steps on 5-row batches: losses rtol 1e-6, first-step gradients rtol 1e-5 / atol 1e-7
    (rows are independent; only the GEMMs' float32 summation order changes). 8 slices of 5 rows:
    5 slices of one row."""
    reference, model = tiny_hf_causal_lm(kind, seed=0), tiny_hf_causal_lm(kind, seed=0)
    if recompute:  # each slice is checkpointed on its own: chunk_batch wraps the checkpointed forward
        apply_recompute(model.model.layers)
    apply_chunk_batch(dict(model.model.layers.named_children()), num_chunks)
    assert all(is_chunked(layer) for layer in model.model.layers)
    _assert_close(train_steps(reference, BATCHES), train_steps(model, BATCHES))


def test_what_is_sliced_and_what_goes_whole():
    hidden, mask, cache_position = torch.zeros(4, 3, 2), torch.ones(4, 1, 3, 3), torch.arange(4)
    shared = torch.zeros(1, 3)  # [1, S]: shared by every row
    args = (hidden, {"mask": mask, "rope": (torch.ones(4, 3, 5), torch.ones(4, 3, 5))}, cache_position, shared, 7)
    slices = slice_batch(args, 4, 2)
    assert [s[0].shape[0] for s in slices] == [2, 2] and [s[1]["mask"].shape[0] for s in slices] == [2, 2]
    assert [s[1]["rope"][1].shape[0] for s in slices] == [2, 2]
    assert all(s[2] is cache_position and s[3] is shared and s[4] == 7 for s in slices)
    joined = join_batch([(torch.ones(2, 3), None), (torch.zeros(2, 3), None)], "layer")
    assert joined[0].shape == (4, 3) and joined[1] is None
    with pytest.raises(ValueError, match=r"0-dim tensor.*chunk_batch_plan\.apply_modules"):
        join_batch([torch.tensor(1.0), torch.tensor(2.0)], "model.layers.0")


def test_a_batch_of_one_row_runs_whole_with_a_warning(caplog):
    layer = nn.Linear(4, 4)
    apply_chunk_batch({"proj": layer}, 2)
    with caplog.at_level(logging.WARNING):
        out = layer(torch.ones(1, 3, 4))
    assert out.shape == (1, 3, 4) and "proj got a batch of 1 rows; it runs whole" in caplog.text
    with pytest.raises(ValueError, match="already chunked"):
        apply_chunk_batch({"proj": layer}, 2)


def _forward_peak(model, ids) -> int:
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(input_ids=ids, labels=ids).loss.backward()
    return sum(per_device["Total"] for per_device in tracker.get_tracker_snapshot("peak").values())


def test_the_forward_peak_falls():
    """A block's MLP intermediates ([tokens, intermediate]) exist for one slice at a time: with
    recompute (the saved activations are only the blocks' inputs) the step's peak, measured by
    torch's MemTracker, falls."""
    ids = make_token_batches(vocab_size=256, global_batch=8, seq_len=64, steps=1)[0]
    kwargs = {"intermediate_size": 1024}
    plain, chunked = tiny_hf_causal_lm("llama", seed=0, **kwargs), tiny_hf_causal_lm("llama", seed=0, **kwargs)
    for model in (plain, chunked):
        apply_recompute(model.model.layers)
    apply_chunk_batch(dict(chunked.model.layers.named_children()), 4)
    assert _forward_peak(chunked, ids) < 0.9 * _forward_peak(plain, ids)


def test_the_facade_plans_it_and_refuses_it_with_compile():
    model = FSDPTurbo({"chunk_batch": True, "chunk_batch_plan": {"num_chunks": 3}}, tiny_hf_causal_lm("llama"))
    plan = model.fsdp_turbo_plans["chunk_batch"]
    assert plan.modules == ("model.layers.0", "model.layers.1") and plan.num_chunks == 3
    assert all(is_chunked(layer) for layer in model.model.layers)
    with pytest.raises(ConfigError) as raised:
        FSDPTurboConfig(chunk_batch=True, compile=True)
    assert raised.value.field == "chunk_batch"
    with pytest.raises(ConfigError) as raised:
        FSDPTurboConfig(chunk_batch=True, chunk_batch_plan={"num_chunks": 1})
    assert raised.value.field == "chunk_batch_plan.num_chunks"
