"""Chunked loss: the function against F.cross_entropy, the HF path against the plain model,
edge cases, and the peak memory (MemTracker) against the plain model's."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch.distributed._tools.mem_tracker import MemTracker

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import ModelFactsConfig, resolve_model_facts
from fsdp_turbo.core.testing import make_token_batches, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo import FSDPTurbo
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
from fsdp_turbo.memory.chunk_loss import chunked_cross_entropy, install_chunked_loss

LOSS_RTOL = 1e-5
GRAD = {"rtol": 1e-5, "atol": 1e-7}


def _inputs(tokens=37, hidden=16, vocab=101, dtype=torch.float32, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=g).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::5] = -100
    return h, w, b, labels


def _reference(h, w, b, labels, *, z=0.0, cap=None, reduction="mean"):
    logits = F.linear(h, w, b).float()
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    if z:
        loss = loss + z * (torch.logsumexp(logits, -1).square() * (labels != -100)).sum()
    return loss / (labels != -100).sum() if reduction == "mean" else loss


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("z,cap", [(0.0, None), (1e-3, None), (0.0, 3.0), (1e-4, 30.0)])
def test_function_matches_cross_entropy(chunk, bias, z, cap):
    h, w, b, labels = _inputs(bias=bias)
    expected = _reference(h, w, b, labels, z=z, cap=cap)
    got = chunked_cross_entropy(h, w, labels, bias=b, chunk_size=chunk, z_loss_weight=z, logit_softcap=cap)
    torch.testing.assert_close(got, expected, rtol=LOSS_RTOL, atol=0)
    for a, e in zip(_grads(got, h, w, b), _grads(expected, h, w, b), strict=True):
        torch.testing.assert_close(a, e, **GRAD)


def test_sum_reduction_num_items_and_batched_shapes():
    h, w, _, labels = _inputs(tokens=24)
    h3, labels3 = h.reshape(2, 12, -1), labels.reshape(2, 12)
    torch.testing.assert_close(chunked_cross_entropy(h3, w, labels3, reduction="sum", chunk_size=5),
                               _reference(h, w, None, labels, reduction="sum"), rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(chunked_cross_entropy(h3, w, labels3, num_items=torch.tensor(7), chunk_size=5),
                               _reference(h, w, None, labels, reduction="sum") / 7, rtol=LOSS_RTOL, atol=0)


def test_backward_twice_gives_the_same_gradients_each_time():
    """A zero-bubble pipeline's split backward runs the loss's backward for the input
    gradients, then again for the weight gradients: each run gives the reference's."""
    h, w, _, labels = _inputs()
    (h_ref, w_ref) = torch.autograd.grad(_reference(h, w, None, labels) * 3, (h, w))
    loss = chunked_cross_entropy(h, w, labels, chunk_size=8, backward_twice=True) * 3
    (first,) = torch.autograd.grad(loss, (h,), retain_graph=True)
    (second,) = torch.autograd.grad(loss, (w,))
    torch.testing.assert_close(first, h_ref, **GRAD)
    torch.testing.assert_close(second, w_ref, **GRAD)


def test_all_labels_ignored_gives_zero_not_nan():
    h, w, _, labels = _inputs()
    loss = chunked_cross_entropy(h, w, torch.full_like(labels, -100), chunk_size=8)
    assert loss.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in _grads(loss, h, w))


def test_one_valid_token():
    h, w, _, labels = _inputs()
    only = torch.full_like(labels, -100)
    only[11] = 3
    got = chunked_cross_entropy(h, w, only, chunk_size=4)
    expected = F.cross_entropy(F.linear(h[11:12], w), only[11:12])
    torch.testing.assert_close(got, expected, rtol=LOSS_RTOL, atol=0)
    for a, e in zip(_grads(got, h, w), _grads(expected, h, w), strict=True):
        torch.testing.assert_close(a, e, **GRAD)


def test_vocab_and_tokens_not_divisible_by_the_chunk():
    h, w, _, labels = _inputs(tokens=29, vocab=257)
    got = chunked_cross_entropy(h, w, labels, chunk_size=6)
    expected = _reference(h, w, None, labels)
    torch.testing.assert_close(got, expected, rtol=LOSS_RTOL, atol=0)
    for a, e in zip(_grads(got, h, w), _grads(expected, h, w), strict=True):
        torch.testing.assert_close(a, e, **GRAD)


def test_bf16_inputs_accumulate_in_fp32():
    h, w, _, labels = _inputs(dtype=torch.bfloat16)
    got = chunked_cross_entropy(h, w, labels, chunk_size=8)
    assert got.dtype == torch.float32
    expected = F.cross_entropy(F.linear(h, w).float(), labels)  # HF's own bf16 recipe
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    for a, e in zip(_grads(got, h, w), _grads(expected, h, w), strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=1e-3)


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch < 2.13")
def test_agrees_with_torch_linear_cross_entropy():
    h, w, _, labels = _inputs(tokens=64, vocab=300)
    ours = chunked_cross_entropy(h, w, labels, chunk_size=16)
    theirs = chunked_cross_entropy(h, w, labels, chunk_size=16, backend="torch")
    torch.testing.assert_close(ours, theirs, rtol=LOSS_RTOL, atol=0)
    for a, e in zip(_grads(ours, h, w), _grads(theirs, h, w), strict=True):
        torch.testing.assert_close(a, e, **GRAD)
    with pytest.raises(ValueError, match="z-loss"):
        chunked_cross_entropy(h, w, labels, z_loss_weight=1e-4, backend="torch")


# ----- the HF model path ------------------------------------------------------------------
BATCHES = make_token_batches(vocab_size=256, global_batch=2, seq_len=16, steps=3)


def _labelled(model, ids):
    labels = ids.clone()
    labels[:, :3] = -100
    return model(input_ids=ids, labels=labels).loss


def _assert_close_records(reference, got):
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(reference.losses), rtol=LOSS_RTOL, atol=0)
    for name, grad in reference.grads.items():
        torch.testing.assert_close(got.grads[name], grad, **GRAD, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_plain_api_on_hf_model(kind):
    reference, model = tiny_hf_causal_lm(kind, seed=0), tiny_hf_causal_lm(kind, seed=0)
    install_chunked_loss(model, chunk_size=5)
    _assert_close_records(train_steps(reference, BATCHES, loss_fn=_labelled),
                          train_steps(model, BATCHES, loss_fn=_labelled))
    # AdamW's first steps are ~lr * g / (|g| + eps): an element whose gradient is near eps
    # (1e-8) moves by a visible part of lr (1e-2) on a 1e-10 gradient difference, and
    # AdamW is blind to gradient scale anyway, so the gradients above (rtol 1e-5) are the
    # strict check. Parameters: relative L2 per tensor <= 2e-4 and every element within
    # 2e-4 = lr / 50 (measured on Llama: 7.7e-5 and 1.4e-4, on q_proj).
    after = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        assert (after[name] - p).norm() / p.norm() <= 2e-4, name
        torch.testing.assert_close(after[name], p, rtol=0, atol=2e-4)


def test_facade_head_runs_once_logits_are_not_built_and_inference_is_unchanged():
    reference = tiny_hf_causal_lm("llama", seed=0)
    config = FSDPTurboConfig(chunk_loss=True, chunk_loss_plan={"chunk_size": 7})
    model = FSDPTurbo(config, tiny_hf_causal_lm("llama", seed=0))
    calls = []
    model.lm_head.register_forward_hook(lambda m, i, o: calls.append(tuple(o.shape)))
    ids = BATCHES[0]
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None and calls == [(2, 16, 0)]
    torch.testing.assert_close(out.loss, reference(input_ids=ids, labels=ids).loss, rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    _assert_close_records(train_steps(reference, BATCHES, loss_fn=_labelled),
                          train_steps(model, BATCHES, loss_fn=_labelled))


def test_hf_shift_labels_and_num_items_in_batch():
    reference, model = tiny_hf_causal_lm("qwen3", seed=0), tiny_hf_causal_lm("qwen3", seed=0)
    install_chunked_loss(model, chunk_size=4)
    ids = BATCHES[1]
    shift = torch.roll(ids, -1, dims=1)
    shift[:, -1] = -100
    for kwargs in ({"labels": ids, "num_items_in_batch": torch.tensor(50)}, {"shift_labels": shift}):
        if "shift_labels" in kwargs:
            kwargs = {**kwargs, "labels": ids}
        expected, got = reference(input_ids=ids, **kwargs).loss, model(input_ids=ids, **kwargs).loss
        torch.testing.assert_close(got, expected, rtol=LOSS_RTOL, atol=0)


def test_z_loss_on_the_hf_path():
    model = tiny_hf_causal_lm("llama", seed=0)
    reference = tiny_hf_causal_lm("llama", seed=0)
    install_chunked_loss(model, chunk_size=6, z_loss_weight=1e-3)
    ids = BATCHES[2]
    logits = reference(input_ids=ids).logits.reshape(-1, 256)
    labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].reshape(-1)
    expected = _reference_from_logits(logits, labels, z=1e-3)
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, expected, rtol=LOSS_RTOL, atol=0)


def _reference_from_logits(logits, labels, z):
    valid = labels != -100
    loss = F.cross_entropy(logits, labels, reduction="sum") + z * (torch.logsumexp(logits, -1)[valid] ** 2).sum()
    return loss / valid.sum()


def test_config_errors():
    with pytest.raises(ConfigError, match="head_module"):
        FSDPTurbo(FSDPTurboConfig(chunk_loss=True, model_facts={"head_module": "nope"}), tiny_hf_causal_lm())
    with pytest.raises(ConfigError, match="no output embedding"):  # not HF: the head must be named
        FSDPTurbo(FSDPTurboConfig(chunk_loss=True), torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ConfigError, match="2-D"):
        FSDPTurbo(FSDPTurboConfig(chunk_loss=True, model_facts={"head_module": "model.norm"}),
                  tiny_hf_causal_lm())


def _peak_bytes(model, ids) -> int:
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(input_ids=ids, labels=ids).loss.backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_peak_memory_at_vocab_32768_is_under_half():
    ids = torch.randint(0, 32768, (2, 256), generator=torch.Generator().manual_seed(0))
    kwargs = {"vocab_size": 32768, "num_hidden_layers": 1}
    plain = _peak_bytes(tiny_hf_causal_lm("llama", seed=0, **kwargs), ids)
    model = tiny_hf_causal_lm("llama", seed=0, **kwargs)
    install_chunked_loss(model, chunk_size=64)
    chunked = _peak_bytes(model, ids)
    assert chunked < 0.5 * plain, (chunked, plain)


class _LogitsLM(torch.nn.Module):
    """A model that returns logits and has no HF head API (as torchtitan's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.output = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32, bias=False)

    def forward(self, tokens):
        return self.output(self.embed(tokens))


def test_a_model_that_returns_logits_gets_its_chunked_loss_through_lm_loss(caplog):
    from fsdp_turbo.fsdp_turbo import lm_loss

    tokens = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(2))
    labels = F.pad(tokens[:, 1:], (0, 1), value=-100)
    expected_model = _LogitsLM()
    expected = F.cross_entropy(expected_model(tokens).flatten(0, 1), labels.flatten())
    expected.backward()
    model = _LogitsLM()
    install_chunked_loss(model, resolve_model_facts(model, ModelFactsConfig(head_module="output")), chunk_size=6)
    loss = lm_loss(model, labels, tokens)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, dict(expected_model.named_parameters())[name].grad,
                                   rtol=1e-5, atol=1e-7)
    with caplog.at_level("WARNING"):  # a plain call still gets its logits, with one warning
        assert model(tokens).shape == (2, 10, 32)
    assert "lm_loss" in caplog.text
