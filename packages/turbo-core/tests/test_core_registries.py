"""Op registry, transform registry, device layer and logging."""

import logging

import pytest
import torch

from fsdp_turbo.core import device, ops
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.logging import get_logger, warn_once
from fsdp_turbo.core.plugin import Stage, Transform, TransformRegistry


def test_portable_fallback_and_device_kernel(op_name, caplog):
    @ops.register_op(op_name)
    def portable(x):
        return x * 2

    @ops.register_op(op_name, "npu")
    def npu_kernel(x):
        return x * 3

    x = torch.ones(2)
    assert torch.equal(ops.call_op(op_name, "cpu", x), x * 2)
    assert ops.get_op(op_name, "npu") is npu_kernel
    with caplog.at_level(logging.WARNING, logger="fsdp_turbo"):
        assert ops.get_op(op_name, "cuda") is portable
        assert ops.get_op(op_name, "cuda") is portable
    assert sum("no cuda kernel" in r.getMessage() for r in caplog.records) == 1
    assert ops.registered_ops()[op_name] == ("npu", "portable")


def test_duplicate_kernel_is_refused(op_name):
    ops.register_op(op_name)(lambda x: x)
    with pytest.raises(ValueError, match="already has"):
        ops.register_op(op_name)(lambda x: x + 1)
    replacement = ops.register_op(op_name, override=True)(lambda x: x + 1)
    assert ops.get_op(op_name, "cpu") is replacement


def test_unknown_op():
    with pytest.raises(KeyError, match="no op named"):
        ops.get_op("does_not_exist", "cpu")


class _Named(Transform):
    def __init__(self, name, stage):
        self.name, self.stage = name, stage

    def plan(self, config, model, parallel_state, upstream, facts):
        return None

    def apply(self, model, plan, parallel_state):
        return model


def test_transform_registry_orders_by_stage():
    registry = TransformRegistry(load_entry_points=False)
    registry.register(_Named("b", Stage.FULLY_SHARD))
    registry.register(_Named("a", Stage.QUANTIZE))
    registry.register(_Named("c", Stage.TENSOR_PARALLEL))
    assert [t.name for t in registry.all()] == ["a", "c", "b"]
    assert registry.get("c").stage == Stage.TENSOR_PARALLEL
    registry.unregister("c")
    assert registry.get("c") is None


def test_entry_point_transforms_are_transforms():
    # Whatever packages are installed, every entry point must load a Transform.
    for transform in TransformRegistry().all():
        assert isinstance(transform, Transform) and transform.name


def test_stages_follow_the_pipeline_order():
    order = [Stage.QUANTIZE, Stage.TENSOR_PARALLEL, Stage.EXPERT_PARALLEL, Stage.CONTEXT_PARALLEL,
             Stage.RECOMPUTE, Stage.SWAP_ACTIVATION, Stage.FULLY_SHARD, Stage.OPTIMIZER_HOOKS]
    assert order == sorted(order)


def test_device_layer_on_cpu(monkeypatch):
    monkeypatch.delenv(device.DEVICE_ENV, raising=False)
    assert device.detect_device_type() == "cpu"
    assert device.backend_for("cpu") == "gloo"
    assert device.backend_for("cuda") == "nccl"
    assert device.backend_for("npu") == "hccl"
    assert device.new_stream("cpu") is None
    with device.stream_context(None):
        buffer = device.pinned_empty((3,), torch.float32, "cpu")
    assert buffer.shape == (3,) and not buffer.is_pinned()
    assert device.current_device("cpu") == torch.device("cpu")


def test_device_env_override_and_errors(monkeypatch):
    monkeypatch.setenv(device.DEVICE_ENV, "cpu")
    assert device.detect_device_type() == "cpu"
    with pytest.raises(ConfigError, match="device_type"):
        device.detect_device_type("tpu")


def test_npu_request_without_torch_npu_is_a_clear_error():
    pytest.importorskip("torch")
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="torch_npu"):
            device.detect_device_type("npu")
    else:
        assert device.detect_device_type("npu") == "npu"


def test_logger_is_rank_aware(monkeypatch, caplog):
    log = get_logger("test")
    with caplog.at_level(logging.INFO, logger="fsdp_turbo"):
        monkeypatch.setenv("RANK", "1")
        log.info("hidden on rank 1")
        log.info("shown on every rank", all_ranks=True)
        monkeypatch.setenv("RANK", "0")
        log.info("shown on rank 0")
        warn_once(log, "once")
        warn_once(log, "once")
    messages = [r.getMessage() for r in caplog.records]
    assert "[rank1] shown on every rank" in messages
    assert "[rank0] shown on rank 0" in messages
    assert not any("hidden" in m for m in messages)
    assert messages.count("[rank0] once") == 1


class _Needs(_Named):
    def __init__(self, name, stage, requires=()):
        super().__init__(name, stage)
        self.requires = requires


def test_planning_order_puts_each_plan_after_the_plans_it_needs():
    from fsdp_turbo.core.plugin import planning_order

    # As the built-ins: quantize needs TP, TP needs EP, FSDP needs EP and chunk loss.
    transforms = [_Needs("quantize", 100, ("tensor_parallel",)), _Needs("tensor_parallel", 200, ("expert_parallel",)),
                  _Needs("expert_parallel", 300), _Needs("chunk_loss", 550),
                  _Needs("fully_shard", 700, ("expert_parallel", "chunk_loss", "not_enabled"))]
    order = [t.name for t in planning_order(transforms)]
    assert order == ["expert_parallel", "tensor_parallel", "quantize", "chunk_loss", "fully_shard"]
    with pytest.raises(ValueError, match="cycle"):
        planning_order([_Needs("a", 1, ("b",)), _Needs("b", 2, ("a",))])


def test_whether_a_feature_is_on_comes_from_the_features_table():
    from fsdp_turbo.core.compile import CompileTransform
    from fsdp_turbo.core.features import FEATURES
    from fsdp_turbo.core.parallel_state import ParallelState
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

    for transform in [*TransformRegistry().all(), CompileTransform()]:
        if any(f.transform == transform.name for f in FEATURES):
            assert type(transform).is_enabled is Transform.is_enabled, transform  # no second rule
    alone = ParallelState(FSDPTurboConfig().validate(1), 0, "cpu", distributed=False)
    launched = ParallelState(FSDPTurboConfig().validate(1), 0, "cpu", distributed=True)
    assert CompileTransform().is_enabled(FSDPTurboConfig(compile=True), alone)
    assert not CompileTransform().is_enabled(FSDPTurboConfig(), alone)
    fsdp = next(f for f in FEATURES if f.transform == "fully_shard")
    assert not fsdp.requested(FSDPTurboConfig(), alone) and fsdp.requested(FSDPTurboConfig(), launched)
    # A third-party transform has no row, so it must say itself when it is on.
    with pytest.raises(NotImplementedError, match="override is_enabled"):
        _Named("third_party", 900).is_enabled(FSDPTurboConfig(), alone)
