"""Activation swap in one process: the forced CPU path against an identical unswapped model."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo import FSDPTurbo
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
from fsdp_turbo.memory.swap_activation import SWAPPER_ATTR, ActivationSwapper, swap_activations
from fsdp_turbo.memory.swap_activation.group import DTensorHandle, Handle, State
from fsdp_turbo.memory.swap_activation.mover import Mover, is_dense

pytest.importorskip("transformers")


def _batches(steps, *, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 16), generator=generator) for _ in range(steps)]


def _storage(tensor):
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        with torch.no_grad():
            tensor = tensor.to_local()
    return tensor.untyped_storage().data_ptr()


def _assert_same_grads(model, ref):
    for (name, param), (_, ref_param) in zip(model.named_parameters(), ref.named_parameters()):
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-6, atol=0, msg=name)


def _assert_same_params(model, ref):
    for (name, param), (_, ref_param) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(param, ref_param, rtol=1e-6, atol=0, msg=name)


@pytest.fixture
def copied(monkeypatch):
    """Every device tensor the swapper copies out, as it was before the copy."""
    seen = []
    original = Mover.copy_out

    def spy(self, entries):
        seen.extend(entry.device for entry in entries)
        return original(self, entries)

    monkeypatch.setattr(Mover, "copy_out", spy)
    return seen


def _spy_packs(swapper):
    """(storage, packed) for every tensor autograd saved under the swapper's hooks."""
    seen = []
    original = swapper._pack

    def spy(group, tensor):
        packed = original(group, tensor)
        seen.append((_storage(tensor), packed))
        return packed

    swapper._pack = spy
    return seen


def test_plain_api_trains_like_the_unswapped_model(copied):
    model = tiny_hf_causal_lm("llama", seed=0, num_hidden_layers=3)
    ref = copy.deepcopy(model)
    param_storages = {_storage(p) for p in model.parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    swapper = ActivationSwapper(model.model.layers, force=True).attach()
    packs = _spy_packs(swapper)
    for step, ids in enumerate(_batches(3)):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m.loss = m(input_ids=ids, labels=ids).loss
            m.loss.backward()
        torch.testing.assert_close(model.loss, ref.loss, rtol=1e-6, atol=0)
        if step == 0:
            _assert_same_grads(model, ref)
        opt.step()
        ref_opt.step()
    _assert_same_params(model, ref)
    swapper.detach()

    stats = swapper.stats
    assert stats.tensors_out > 0 and stats.tensors_in == stats.tensors_out
    assert stats.bytes_in == stats.bytes_out > 0
    assert set(stats.out_by_module) == {0, 1}, "the last layer's activations stay on device"
    assert stats.prefetches == 2 * 3 and stats.sync_loads == 0
    assert not {_storage(t) for t in copied} & param_storages
    # Views of the weights (linear saves weight.t()) went through the hook and stayed raw.
    assert any(s in param_storages and isinstance(p, torch.Tensor) for s, p in packs)
    assert not any(s in param_storages for s, p in packs if isinstance(p, Handle))


class ViewBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x).tanh()  # tanh saves its output
        gapped = y[:, 1:].t()  # a transposed view with gaps
        flipped = y.t()  # a dense transposed view
        return y.sin() + (gapped * gapped.cos()).mean() + (flipped * flipped).mean()


def test_views_round_trip(copied):
    torch.manual_seed(0)
    model = nn.Sequential(*[ViewBlock() for _ in range(3)])
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    ref(x).sum().backward()
    with swap_activations(list(model), force=True) as swapper:
        packs = _spy_packs(swapper)
        out = model(x)
        last = swapper._sequence.last
        assert last.state is State.OPEN, "the last block is never offloaded"
        assert last.prev.state is last.prev.prev.state is State.OFFLOADED, "device copies dropped before backward"
    out.sum().backward()  # unpacking still works after detach
    _assert_same_grads(model, ref)
    assert not swapper.attached
    assert any(not is_dense(t.size(), t.stride()) for t in copied)
    assert any(is_dense(t.size(), t.stride()) and not t.is_contiguous() for t in copied)
    handles = [p for _, p in packs if isinstance(p, Handle)]
    assert len({id(h.entry) for h in handles}) < len(handles), "flipped * flipped saves one view once"
    assert swapper.stats.sync_loads == 0


@pytest.mark.parametrize("order", ["sum", "first_forward_first", "last_forward_first"])
def test_gradient_accumulation(order):
    model = tiny_hf_causal_lm("llama", seed=0, num_hidden_layers=3)
    ref = copy.deepcopy(model)
    batches = _batches(2)

    def run(m):
        losses = [m(input_ids=ids, labels=ids).loss for ids in batches]
        if order == "sum":
            (losses[0] + losses[1]).backward()
        else:
            for loss in losses if order == "first_forward_first" else losses[::-1]:
                loss.backward()

    run(ref)
    with swap_activations(model.model.layers, force=True) as swapper:
        run(model)
    _assert_same_grads(model, ref)
    stats = swapper.stats
    assert stats.out_by_module == {0: stats.out_by_module[0], 1: stats.out_by_module[1]}
    assert stats.tensors_in == stats.tensors_out > 0


def test_facade_trains_like_the_unswapped_model():
    model = tiny_hf_causal_lm("llama", seed=0)
    ref = copy.deepcopy(model)
    config = FSDPTurboConfig(swap_activation=True, swap_force=True, device_type="cpu")
    model = FSDPTurbo(config, model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for ids in _batches(3):
        losses = []
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            losses.append(m(input_ids=ids, labels=ids).loss)
            losses[-1].backward()
            o.step()
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    _assert_same_params(model, ref)
    stats = getattr(model, SWAPPER_ATTR).stats
    assert stats.tensors_out > 0 and set(stats.out_by_module) == {0}


def test_no_op_on_cpu_without_force():
    model = tiny_hf_causal_lm("llama", seed=0)
    model = FSDPTurbo(FSDPTurboConfig(swap_activation=True, device_type="cpu"), model)
    assert not hasattr(model, SWAPPER_ATTR)
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in model.model.layers)
    swapper = ActivationSwapper(model.model.layers, device_type="cpu").attach()
    assert not swapper.attached and not swapper.enabled


def test_plan_matching_nothing_is_a_config_error():
    config = FSDPTurboConfig(swap_activation=True, swap_activation_plan=["decoder.blocks.*"], device_type="cpu")
    with pytest.raises(ConfigError, match="swap_activation_plan"):
        FSDPTurbo(config, tiny_hf_causal_lm("llama", seed=0))


def test_recomputed_blocks_are_swapped_and_blocks_inside_them_are_skipped():
    model = tiny_hf_causal_lm("llama", seed=0, num_hidden_layers=3)
    config = FSDPTurboConfig(recompute=True, recompute_plan=["model.layers.{1-2}"], swap_activation=True,
                             swap_activation_plan=["model.layers.{0-1}.mlp", "model.layers.2"],
                             swap_force=True, device_type="cpu")
    model = FSDPTurbo(config, model)
    plan = model.fsdp_turbo_plans["swap_activation"]
    assert plan.blocks == ("model.layers.0.mlp", "model.layers.2") and plan.recomputed == ("model.layers.2",)
    assert plan.skipped == (("model.layers.1.mlp", "inside a recomputed block"),)  # its layer's recompute re-runs it
    assert model.model.layers[0].mlp._forward_pre_hooks and model.model.layers[2]._forward_pre_hooks
    assert not model.model.layers[1].mlp._forward_pre_hooks


def test_composable_checkpoint_owns_its_module():
    from torch.distributed._composable import checkpoint

    model = tiny_hf_causal_lm("llama", seed=0, num_hidden_layers=3)
    ref = copy.deepcopy(model)
    checkpoint(model.model.layers[1])
    ids = _batches(1)[0]
    ref(input_ids=ids, labels=ids).loss.backward()
    with swap_activations(model.model.layers, force=True) as swapper:
        model(input_ids=ids, labels=ids).loss.backward()
    assert swapper.skipped == [1]
    assert set(swapper.stats.out_by_module) == {0}
    _assert_same_grads(model, ref)


def test_hooks_are_exited_when_forward_raises():
    class Boom(nn.Module):
        def forward(self, x):
            x.exp()  # saves a tensor under the swap hooks, then fails
            raise RuntimeError("boom")

    blocks = nn.Sequential(nn.Linear(4, 4), Boom())
    with swap_activations(list(blocks), force=True) as swapper:
        with pytest.raises(RuntimeError, match="boom"):
            blocks(torch.randn(2, 4, requires_grad=True))
        packed = swapper.stats.tensors_packed
        assert not swapper._active
        torch.randn(3, requires_grad=True).exp().sum().backward()
        assert swapper.stats.tensors_packed == packed


def test_no_grad_min_bytes_and_bad_arguments():
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    x = torch.randn(2, 4, requires_grad=True)
    with swap_activations(list(blocks), force=True) as swapper:
        with torch.no_grad():
            blocks(x)
        assert swapper.stats.tensors_packed == 0 and swapper._sequence is None
    with swap_activations(list(blocks), force=True, min_bytes=1 << 20) as swapper:
        blocks(x).sum().backward()
    assert swapper.stats.tensors_out == 0
    with pytest.raises(ValueError, match="inside"):
        ActivationSwapper([blocks, blocks[0]], force=True)
    with pytest.raises(ValueError, match="twice"):
        ActivationSwapper([blocks[0], blocks[0]], force=True)


@pytest.fixture
def cpu_mesh():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_activations_are_swapped_as_local_tensors(cpu_mesh, copied):
    from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    ref = copy.deepcopy(model)
    distribute_module(model, cpu_mesh)
    x = torch.randn(4, 8)
    ref(x).sum().backward()
    with swap_activations(list(model), force=True) as swapper:
        packs = _spy_packs(swapper)
        model(distribute_tensor(x, cpu_mesh, [Replicate()])).sum().backward()
    for (name, param), (_, ref_param) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, rtol=1e-6, atol=0, msg=name)
    assert any(isinstance(p, DTensorHandle) for _, p in packs)
    param_storages = {_storage(p) for p in model.parameters()}
    assert copied and not {_storage(t) for t in copied} & param_storages


def test_recompute_and_the_swap_stack_on_the_same_blocks():
    """The swap moves what recompute keeps: each checkpointed layer's inputs (one [B, S, H]
    tensor per layer but the last, which stays resident). Losses and gradients are exact."""
    from torch.distributed._tools.mem_tracker import MemTracker

    ids = _batches(1)[0]
    results = {}
    for swap in (False, True):
        config = FSDPTurboConfig(recompute=True, swap_activation=swap, swap_force=swap)
        model = FSDPTurbo(config, tiny_hf_causal_lm("llama", seed=0, num_hidden_layers=4))
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            loss = model(input_ids=ids, labels=ids).loss
            acts = {str(k): v for k, v in tracker.get_tracker_snapshot("current")[torch.device("cpu")].items()}
            swapper = getattr(model, SWAPPER_ATTR, None)
            on_host = swapper.stats.bytes_out - swapper.stats.bytes_in if swapper else 0
            loss.backward()
        results[swap] = (loss.detach(), acts["_MemRefType.ACT"] - on_host, model)
    (loss_alone, device_alone, alone), (loss_both, device_both, both) = results[False], results[True]
    assert torch.equal(loss_alone, loss_both)
    _assert_same_grads(both, alone)
    hidden_bytes = ids.numel() * 64 * 4  # one fp32 [B, S, H] layer input
    assert device_alone - device_both == 3 * hidden_bytes
