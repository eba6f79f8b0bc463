"""The one error type for bad configuration, shared by every package."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration problem found before any collective runs.

    The message always names the field, the offending value and the fix, so that
    every rank raises the same, actionable error.
    """

    def __init__(self, field: str, value: Any, fix: str, *, reason: str | None = None) -> None:
        self.field = field
        self.value = value
        self.fix = fix
        self.reason = reason
        detail = f": {reason}" if reason else ""
        super().__init__(f"{field}={value!r} is invalid{detail}. Fix: {fix}")

    def __reduce__(self):
        # Keep the structured fields when the error crosses a process boundary.
        return (_rebuild_config_error, (self.field, self.value, self.fix, self.reason))


def _rebuild_config_error(field: str, value: Any, fix: str, reason: str | None) -> ConfigError:
    return ConfigError(field, value, fix, reason=reason)


class CheckpointError(ConfigError):
    """A checkpoint that does not fit the model: missing, unexpected or misshapen tensors,
    a missing or truncated file, or a directory that is not a model. Found on every rank,
    before any collective; the field is the tensor, file or path at fault."""

    def __reduce__(self):
        return (_rebuild_checkpoint_error, (self.field, self.value, self.fix, self.reason))


def _rebuild_checkpoint_error(field: str, value: Any, fix: str, reason: str | None) -> CheckpointError:
    return CheckpointError(field, value, fix, reason=reason)
