"""The shared field checks (``core.validation``): numbers must be finite, keys must be text,
and a checkpoint index must not name files outside its folder."""

import json
import math
import os

import pytest
import torch

from fsdp_turbo.checkpoint.files import INDEX, CheckpointFiles
from fsdp_turbo.core.errors import CheckpointError, ConfigError
from fsdp_turbo.core.validation import check_float
from fsdp_turbo.fsdp_turbo_config import ChunkLossPlanConfig, FSDPTurboConfig


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_check_float_refuses_nan_and_infinity_whatever_the_bounds(value):
    for bounds in ({}, {"minimum": 0.0}, {"minimum": 0.0, "strict": True}, {"minimum": 0.0, "maximum": 1.0}):
        with pytest.raises(ConfigError) as info:
            check_float(value, "optimizer.lr", **bounds)
        message = str(info.value)
        assert info.value.field == "optimizer.lr"
        assert message.startswith(f"optimizer.lr={value!r} is invalid: NaN and infinity")
        assert "Fix: use a finite number" in message


def test_check_float_keeps_its_bounds_and_returns_a_float():
    assert check_float(3, "f", minimum=0.0) == 3.0 and isinstance(check_float(3, "f"), float)
    assert check_float(1.0, "f", minimum=0.0, maximum=1.0) == 1.0
    with pytest.raises(ConfigError, match=r"f=1\.5 is invalid\. Fix: use a finite number in \[0\.0, 1\.0\]"):
        check_float(1.5, "f", minimum=0.0, maximum=1.0)
    with pytest.raises(ConfigError, match=r"Fix: use a finite number > 0\.0"):
        check_float(0.0, "f", minimum=0.0, strict=True)
    with pytest.raises(ConfigError, match="Fix: use a finite number"):
        check_float("0.1", "f")
    with pytest.raises(ConfigError, match="Fix: use a finite number"):
        check_float(True, "f")


def test_check_float_refuses_an_integer_too_large_for_a_float():
    with pytest.raises(ConfigError, match="too large for a float") as info:
        check_float(10**400, "run.collective_timeout_s", minimum=1.0)
    assert info.value.field == "run.collective_timeout_s"


def test_yaml_nan_in_a_nested_plan_is_refused_at_load(tmp_path):
    """YAML's ``.nan`` and ``.inf`` are floats: the library config refuses them when read."""
    (tmp_path / "c.yaml").write_text("chunk_loss: true\nchunk_loss_plan:\n  z_loss_weight: .nan\n")
    with pytest.raises(ConfigError, match=r"chunk_loss_plan\.z_loss_weight=nan is invalid.*Fix:"):
        FSDPTurboConfig.from_file(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match=r"chunk_loss_plan\.logit_softcap=inf"):
        ChunkLossPlanConfig(logit_softcap=math.inf)


def test_mixed_int_and_str_keys_are_a_config_error_not_a_type_error(tmp_path):
    """Before: ``sorted({1, 'chunk_size'})`` raised TypeError while looking for unknown keys."""
    (tmp_path / "c.yaml").write_text("chunk_loss_plan:\n  chunk_size: 64\n  1: 2\n")
    with pytest.raises(ConfigError) as info:
        FSDPTurboConfig.from_file(tmp_path / "c.yaml")
    assert info.value.field == "chunk_loss_plan.1"
    message = str(info.value)
    assert "the key 1 is not text but int" in message and "Fix: use field names (text) as keys" in message
    assert "chunk_size" in message  # the known fields, to pick from


@pytest.mark.parametrize("key,shown", [("~", "None"), ("yes", "True"), ("1.5", "1.5"), ("7", "7")])
def test_every_non_string_key_names_its_section_and_key(tmp_path, key, shown):
    """YAML 1.1 reads ``~``, ``yes``, ``1.5`` and ``7`` as None, True, a float and an int."""
    (tmp_path / "c.yaml").write_text(f"fsdp_plan:\n  {key}: 1\n")
    with pytest.raises(ConfigError) as info:
        FSDPTurboConfig.from_file(tmp_path / "c.yaml")
    assert info.value.field == f"fsdp_plan.{shown}"
    assert "Fix:" in str(info.value)
    (tmp_path / "top.yaml").write_text(f"{key}: 1\n")  # at the top level: the key alone
    with pytest.raises(ConfigError) as info:
        FSDPTurboConfig.from_file(tmp_path / "top.yaml")
    assert info.value.field == shown


def _checkpoint(folder, weight_map):
    """A real checkpoint folder: config.json, one safetensors file, and ``weight_map`` as its index."""
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, folder / "model.safetensors")
    (folder / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("entry", ["../outside.safetensors", "sub/../../outside.safetensors", "ABSOLUTE"])
def test_an_index_naming_a_file_outside_its_folder_is_refused_before_reading(tmp_path, entry):
    from safetensors.torch import save_file

    outside = tmp_path / "outside.safetensors"
    save_file({"w": torch.ones(2)}, outside)  # readable: only the check stops it
    entry = str(outside) if entry == "ABSOLUTE" else entry
    folder = _checkpoint(tmp_path / "model", {"w": entry})
    with pytest.raises(CheckpointError) as info:
        CheckpointFiles.open(folder)
    message = str(info.value)
    assert info.value.field == f"{folder / INDEX} weight_map['w']" and info.value.value == entry
    assert f"not a file inside {folder}" in message and "Fix: write the index again" in message


def test_an_index_in_the_hub_cache_layout_still_opens(tmp_path):
    """Names are checked, not resolved paths: the hub cache's snapshot files are symlinks into
    ``../../blobs``, and they are the folder's own files."""
    from safetensors.torch import save_file

    blobs = tmp_path / "blobs"
    blobs.mkdir()
    save_file({"w": torch.ones(2)}, blobs / "abc123")
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    os.symlink(os.path.join("..", "..", "blobs", "abc123"), snapshot / "model.safetensors")
    (snapshot / INDEX).write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    files = CheckpointFiles.open(snapshot)
    assert files.shapes == {"w": (2,)}
    assert torch.equal(files.read("w", (slice(None),)), torch.ones(2))
    files.release()
