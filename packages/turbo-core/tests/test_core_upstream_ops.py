"""``fsdp_turbo.ops.registry``: the upstream path to turbo-core's one op registry."""

import pytest
import torch

from fsdp_turbo.core import ops as core_ops
from fsdp_turbo.ops import registry


def test_get_op_takes_the_current_device_and_shares_the_core_registry(op_name, monkeypatch):
    monkeypatch.setenv("FSDP_TURBO_DEVICE", "cpu")  # the current device, as a launcher would set it

    @registry.register_op(op_name)
    def portable(x):
        return x + 1

    @core_ops.register_op(op_name, "cpu")
    def on_cpu(x):
        return x + 2

    assert registry.get_op(op_name) is on_cpu  # the current device's kernel
    assert registry.get_op(op_name, "cuda") is portable  # no CUDA kernel: the portable one
    assert registry.dispatch_op(op_name, torch.zeros(1)).item() == 2
    assert core_ops.get_op(op_name, "cpu") is on_cpu
    assert "cpu" in registry.registered_ops()[op_name]


def test_an_unknown_op_names_the_registered_ones():
    with pytest.raises(KeyError, match="no op named"):
        registry.get_op("no_such_upstream_op")
