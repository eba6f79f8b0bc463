"""Optimizer-state swap on CPU (force=True runs the real swap path with host clones):
bitwise parity with an un-swapped optimizer, host residency between steps,
state_dict round trips, the stream ordering (with recording fake streams), the facade."""

import copy
import gc

import pytest
import torch
from torch import nn

from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo import FSDPTurbo
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
from fsdp_turbo.memory.swap_optimizer import OptimizerStateSwapper, swap_optimizer_states
from fsdp_turbo.memory.swap_optimizer import swapper as swapper_module
from fsdp_turbo.memory.swap_optimizer.transform import HANDLE_ATTR

pytest.importorskip("transformers")

STEPS = 3


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def _groups(model, **extra):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1, **extra}, {"params": no_decay, "weight_decay": 0.0, **extra}]


def _adamw(model):
    return torch.optim.AdamW(_groups(model), lr=1e-2)


def _sgd(model):
    return torch.optim.SGD(_groups(model), lr=1e-2, momentum=0.9)


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 8), generator=g) for _ in range(n)]


def _step(model, optimizer, ids):
    optimizer.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def _same_params(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def _assert_on_host(optimizer, swapper):
    """Every swappable state is the swapper's persistent host buffer between steps."""
    checked = 0
    for param, entry in optimizer.state.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value is swapper.host_buffer(param, key), key
                checked += 1
    assert checked > 0


def _train_pair(make_optimizer, steps=STEPS):
    ref_model = tiny_hf_causal_lm("llama", seed=0)
    model = copy.deepcopy(ref_model)
    ref_opt, opt = make_optimizer(ref_model), make_optimizer(model)
    swapper = swap_optimizer_states(opt, force=True)
    buffers = None
    for ids in _batches(steps):
        _step(ref_model, ref_opt, ids)
        _step(model, opt, ids)
        assert _same_params(ref_model, model)
        _assert_on_host(opt, swapper)
        ptrs = {(id(p), k): v.data_ptr() for p, e in opt.state.items() for k, v in e.items() if v.dim() > 0}
        assert buffers is None or ptrs == buffers  # the host buffers are reused, not re-allocated
        buffers = ptrs
    return ref_model, ref_opt, model, opt, swapper


@pytest.mark.parametrize("make_optimizer", [_adamw, _sgd], ids=["adamw", "sgd_momentum"])
def test_swapped_training_matches_bitwise(make_optimizer):
    _, ref_opt, _, opt, swapper = _train_pair(make_optimizer)
    assert isinstance(swapper, OptimizerStateSwapper) and swapper.enabled and swapper.early_copy_out
    # Step 1 only copies the new states out; steps 2 and 3 copy each group in and out.
    assert swapper.stats.swap_outs == {0: STEPS, 1: STEPS}
    assert swapper.stats.swap_ins == {0: STEPS - 1, 1: STEPS - 1}
    assert swapper.stats.bytes_in > 0 and swapper.stats.bytes_out > swapper.stats.bytes_in
    for (_, ref_entry), (_, entry) in zip(ref_opt.state.items(), opt.state.items(), strict=True):
        assert ref_entry.keys() == entry.keys()
        for key in entry:
            assert torch.equal(ref_entry[key], entry[key]), key
    assert swap_optimizer_states(opt, force=True) is swapper


def test_earlier_groups_are_copied_out_inside_the_step(monkeypatch):
    """Group 0 goes out when group 1 is first read (early copy-out), group 1 after the step."""
    model = tiny_hf_causal_lm("llama", seed=0)
    opt = _adamw(model)
    swapper = swap_optimizer_states(opt, force=True)
    seen = []
    copy_out = swapper._copy_out

    def recording(groups):
        seen.append((list(groups), swapper._in_step, swapper._active))
        copy_out(groups)

    monkeypatch.setattr(swapper, "_copy_out", recording)
    for ids in _batches(2):
        _step(model, opt, ids)
    assert seen == [([0], True, 1), ([0, 1], False, 1)] * 2


def test_state_dict_round_trip_matches_bitwise():
    ref_model, ref_opt, model, opt, _ = _train_pair(_adamw, steps=2)
    saved = copy.deepcopy(opt.state_dict())  # as torch.save would: host values, no swapper
    assert all(v.device.type == "cpu" for e in saved["state"].values() for v in e.values())
    ref_saved = ref_opt.state_dict()
    for key, entry in saved["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, ref_saved["state"][key][name])

    fresh_model = copy.deepcopy(model)
    fresh_opt = _adamw(fresh_model)
    fresh = swap_optimizer_states(fresh_opt, force=True)
    fresh_opt.load_state_dict(saved)
    _assert_on_host(fresh_opt, fresh)  # load_state_dict's post-hook swapped the loaded states out
    for ids in _batches(4)[2:]:
        _step(ref_model, ref_opt, ids)
        _step(fresh_model, fresh_opt, ids)
        assert _same_params(ref_model, fresh_model)
        _assert_on_host(fresh_opt, fresh)


def test_out_of_order_access_still_correct():
    """A custom optimizer reading groups last-to-first: any read makes its group resident,
    and without the torch.optim group-by-group guarantee nothing is copied out early."""

    class ReversedMomentum(torch.optim.Optimizer):
        def __init__(self, groups):
            super().__init__(groups, {"lr": 1e-2})

        @torch.no_grad()
        def step(self, closure=None):
            for group in reversed(self.param_groups):
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    buf = state.setdefault("buf", torch.zeros_like(p))
                    buf.mul_(0.9).add_(p.grad)
                    p.add_(buf, alpha=-group["lr"])

    ref_model = tiny_hf_causal_lm("llama", seed=0)
    model = copy.deepcopy(ref_model)
    ref_opt, opt = ReversedMomentum(_groups(ref_model)), ReversedMomentum(_groups(model))
    swapper = swap_optimizer_states(opt, force=True)
    assert not swapper.early_copy_out
    for ids in _batches(STEPS):
        _step(ref_model, ref_opt, ids)
        _step(model, opt, ids)
        assert _same_params(ref_model, model)
        _assert_on_host(opt, swapper)
    assert swapper.stats.swap_ins == {0: STEPS - 1, 1: STEPS - 1}


def test_a_step_that_raises_is_finished_by_the_next():
    ref_model, ref_opt, model, opt, swapper = _train_pair(_adamw, steps=1)

    def failing():
        raise RuntimeError("closure failed")

    with pytest.raises(RuntimeError, match="closure failed"):
        opt.step(failing)
    for ids in _batches(3)[1:]:
        _step(ref_model, ref_opt, ids)
        _step(model, opt, ids)
        assert _same_params(ref_model, model)
        _assert_on_host(opt, swapper)


def test_remove_brings_states_back():
    _, _, _, opt, swapper = _train_pair(_adamw, steps=1)
    p = opt.param_groups[0]["params"][0]
    host = swapper.host_buffer(p, "exp_avg")
    swapper.remove()
    assert not isinstance(opt.state, swapper_module.SwapStateMap)
    assert opt.state[p]["exp_avg"] is not host and torch.equal(opt.state[p]["exp_avg"], host)
    assert not hasattr(opt, swapper_module.SWAPPER_ATTR)


def test_without_force_on_cpu_it_is_a_no_op():
    model = tiny_hf_causal_lm("llama", seed=0)
    opt = _adamw(model)
    swapper = swap_optimizer_states(opt)
    assert not swapper.enabled
    _step(model, opt, _batches(1)[0])
    assert type(opt.state) is not swapper_module.SwapStateMap
    assert swapper.host_buffer(opt.param_groups[0]["params"][0], "exp_avg") is None


# ----- the stream path, with recording fakes (no accelerator here) ------------------------
class _FakeEvent:
    def __init__(self, log, name):
        self.log, self.name = log, name


class _FakeStream:
    device = torch.device("cpu")

    def __init__(self, log, name):
        self.log, self.name, self.events = log, name, 0

    def __enter__(self):
        self.log.append(f"enter:{self.name}")

    def __exit__(self, *exc):
        self.log.append(f"exit:{self.name}")

    def record_event(self):
        self.events += 1
        event = _FakeEvent(self.log, f"{self.name}{self.events}")
        self.log.append(f"record:{event.name}")
        return event

    def wait_event(self, event):
        self.log.append(f"{self.name}.wait:{event.name}")

    def wait_stream(self, other):
        self.log.append(f"{self.name}.wait_stream:{other.name}")

    def synchronize(self):
        self.log.append(f"{self.name}.sync")


def test_stream_ordering_with_fake_streams(monkeypatch):
    log = []
    side, compute = _FakeStream(log, "side"), _FakeStream(log, "compute")
    monkeypatch.setattr(swapper_module, "new_stream", lambda device_type: side)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: compute)
    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: recorded.append(s.name), raising=False)

    ref_model, model = tiny_hf_causal_lm("llama", seed=0), tiny_hf_causal_lm("llama", seed=0)
    ref_opt, opt = _adamw(ref_model), _adamw(model)
    swapper = swap_optimizer_states(opt, force=True)
    for i, ids in enumerate(_batches(2)):
        log.clear()
        recorded.clear()
        _step(ref_model, ref_opt, ids)
        _step(model, opt, ids)
        assert _same_params(ref_model, model)
        sync = [e for e in log if not e.startswith(("enter", "exit"))]
        if i == 0:  # nothing on the host yet: only copy-outs, each after the compute stream
            assert sync == ["side.wait_stream:compute", "side.wait_stream:compute", "side.sync"]
            assert set(recorded) == {"side"}
        else:
            # group 0 prefetched before the step, group 1 while group 0 updates; each waited on
            # before use; group 0 copied out when group 1 starts, group 1 after the step.
            assert sync == ["record:side1", "compute.wait:side1", "record:side2", "compute.wait:side2",
                            "side.wait_stream:compute", "side.wait_stream:compute", "side.sync"]
            side.events = 0
            assert recorded.count("compute") == recorded.count("side") > 0
    assert swapper.stats.swap_ins == {0: 1, 1: 1}


# ----- DTensor states (one process, world size 1) --------------------------------------------
def test_dtensor_states_keep_mesh_and_placements():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("needs its own process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        plain = [nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(6))]
        dt = [nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])) for p in plain]
        ref_opt, opt = torch.optim.Adam(plain, lr=1e-2), torch.optim.Adam(dt, lr=1e-2)
        swapper = swap_optimizer_states(opt, force=True)
        for step in range(STEPS):
            for a, b in zip(plain, dt):
                grad = torch.full_like(a, 0.1 * (step + 1)) + a.detach()
                a.grad, b.grad = grad, distribute_tensor(grad.clone(), mesh, [Shard(0)])
            ref_opt.step()
            opt.step()
            for a, b in zip(plain, dt):
                assert torch.equal(a.detach(), b.detach().full_tensor())
            for p in dt:
                value = opt.state[p]["exp_avg"]
                assert isinstance(value, DTensor) and value.placements == (Shard(0),)
                with torch.no_grad():  # to_local is a view under grad mode
                    assert value.to_local() is swapper.host_buffer(p, "exp_avg")
        assert swapper.stats.swap_ins[0] == STEPS - 1
    finally:
        dist.destroy_process_group()


# ----- the facade ---------------------------------------------------------------------------------
def test_facade_swaps_the_optimizer_built_afterwards():
    ref_model = tiny_hf_causal_lm("llama", seed=0)
    model = FSDPTurbo(FSDPTurboConfig(swap_optimizer=True, swap_force=True), copy.deepcopy(ref_model))
    handle = getattr(model, HANDLE_ATTR)
    ref_opt, opt = _adamw(ref_model), _adamw(model)
    for ids in _batches(STEPS):
        _step(ref_model, ref_opt, ids)
        _step(model, opt, ids)
        assert _same_params(ref_model, model)
    swapper = getattr(opt, swapper_module.SWAPPER_ATTR)
    assert list(handle.swappers) == [swapper]
    assert getattr(ref_opt, swapper_module.SWAPPER_ATTR, None) is None  # not the model's parameters
    _assert_on_host(opt, swapper)
    assert swapper.stats.swap_outs == {0: STEPS, 1: STEPS}
    assert swapper.stats.swap_ins == {0: STEPS - 1, 1: STEPS - 1}


def test_facade_hook_goes_away_with_the_model():
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    before = len(_global_optimizer_pre_hooks)
    model = FSDPTurbo(FSDPTurboConfig(swap_optimizer=True, swap_force=True),
                      tiny_hf_causal_lm("llama", seed=0))
    assert len(_global_optimizer_pre_hooks) == before + 1
    del model
    gc.collect()
    assert len(_global_optimizer_pre_hooks) == before


def test_facade_without_force_on_cpu_is_a_no_op():
    model = FSDPTurbo(FSDPTurboConfig(swap_optimizer=True), tiny_hf_causal_lm("llama", seed=0))
    assert getattr(model, HANDLE_ATTR, None) is None
    opt = _adamw(model)
    _step(model, opt, _batches(1)[0])
    assert type(opt.state) is not swapper_module.SwapStateMap
    assert not hasattr(opt, swapper_module.SWAPPER_ATTR)
