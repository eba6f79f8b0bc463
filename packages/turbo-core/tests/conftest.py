"""Fixtures shared by turbo-core's tests."""

import pytest

from fsdp_turbo.core import ops


@pytest.fixture
def op_name():
    """A fresh op name, unregistered again after the test."""
    name = "test_op"
    yield name
    ops.unregister_op(name)
