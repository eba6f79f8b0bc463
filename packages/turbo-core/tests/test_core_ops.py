"""turbo-core kernels shared by feature packages: grouped GEMMs and class mix-ins."""

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_matches_per_group_linear_with_empty_groups(dtype):
    from fsdp_turbo.core.grouped_mm import grouped_linear

    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([10, 0, 25, 5, 0])
    x = torch.randn(int(counts.sum()), 32, generator=generator).to(dtype).requires_grad_()
    w = torch.randn(5, 48, 32, generator=generator).to(dtype).requires_grad_()
    out = grouped_linear(x, w, torch.cumsum(counts, 0))
    grad = torch.randn(out.shape, generator=generator).to(dtype)
    out.backward(grad)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    expected = torch.cat([part @ w2[e].T for e, part in enumerate(x2.split(counts.tolist()))])
    expected.backward(grad)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(x.grad, x2.grad, **tol)
    torch.testing.assert_close(w.grad, w2.grad, **tol)
    assert not w.grad[1].any() and not w.grad[4].any()  # empty groups: zero, not missing


def test_grouped_linear_checks_its_shapes():
    from fsdp_turbo.core.grouped_mm import grouped_linear

    with pytest.raises(ValueError, match="one offset per group"):
        grouped_linear(torch.randn(4, 8), torch.randn(3, 8, 8), torch.tensor([4, 4]))


def test_mix_in_keeps_parameters_and_subclasses_the_original():
    from fsdp_turbo.core.mixin import mix_in

    class Twice(torch.nn.Module):
        def forward(self, x):
            return 2 * super().forward(x)

    layer = torch.nn.Linear(3, 3)
    weight = layer.weight
    mix_in(layer, Twice, "Twice", tag=7)
    assert isinstance(layer, torch.nn.Linear) and type(layer).__name__ == "TwiceLinear" and layer.tag == 7
    assert layer.weight is weight and list(layer.state_dict()) == ["weight", "bias"]
    x = torch.randn(2, 3)
    torch.testing.assert_close(layer(x), 2 * torch.nn.functional.linear(x, layer.weight, layer.bias))
    with pytest.raises(ValueError, match="already"):
        mix_in(layer, Twice, "Twice")


def test_grouped_mm_falls_back_only_where_the_kernel_does_not_run(monkeypatch, caplog):
    import logging

    from fsdp_turbo.core import grouped_mm as gm

    a, b = torch.randn(6, 16), torch.randn(2, 16, 8)
    offsets = torch.tensor([2, 6])
    expected = torch.cat([a[:2] @ b[0], a[2:] @ b[1]])

    def no_kernel(*args, **kwargs):
        raise NotImplementedError("no grouped kernel for this backend")

    monkeypatch.setattr(gm, "_runs", {})
    monkeypatch.setattr(torch, "_grouped_mm", no_kernel)
    with caplog.at_level(logging.WARNING, logger="fsdp_turbo"):
        torch.testing.assert_close(gm.grouped_mm(a, b, offsets), expected)
        gm.grouped_mm(a, b, offsets)
    assert sum("grouped GEMMs run as a loop" in r.getMessage() for r in caplog.records) == 1

    # Where the kernel runs, its errors are the caller's (an out-of-memory is never a reason to loop).
    calls = []

    def runs_then_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("CUDA out of memory")
        return torch.zeros(16, 16)

    monkeypatch.setattr(gm, "_runs", {})
    monkeypatch.setattr(torch, "_grouped_mm", runs_then_fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        gm.grouped_mm(a, b, offsets)


def test_the_grouped_kernel_probe_is_invisible_to_selective_recompute(monkeypatch):
    """The first grouped GEMM may come from inside a selective-recompute region. Its probe
    must not enter that region's op log: the recomputation, which does not probe again,
    would be handed the probe's output (it was: 'grouped rows (16) must be padded')."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from fsdp_turbo.core import grouped_mm as gm

    def policy(ctx, func, *args, **kwargs):
        keep = func.overloadpacket is torch.ops.aten._grouped_mm
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    x = torch.randn(6, 16, requires_grad=True)
    weight = torch.randn(2, 8, 16, requires_grad=True)
    offsets = torch.tensor([2, 6])
    expected = gm.grouped_linear(x, weight, offsets)
    monkeypatch.setattr(gm, "_runs", {})  # the next call probes, inside the region
    contexts = functools.partial(create_selective_checkpoint_contexts, policy)
    out = checkpoint(lambda a, w: gm.grouped_linear(a, w, offsets).relu(), x, weight, use_reentrant=False,
                     context_fn=contexts)
    out.sum().backward()
    torch.testing.assert_close(out, expected.relu())
