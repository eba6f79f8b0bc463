"""DCP checkpoints are read as data: a crafted ``.metadata`` or saved object runs nothing."""

import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from fsdp_turbo.checkpoint.safe_dcp import load, read_metadata
from fsdp_turbo.core.errors import CheckpointError


class _CreatesAFile:
    """What an attacker pickles: unpickling it calls ``Path.touch``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (type(self.path).touch, (self.path,))


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(state, folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(folder))


def _load(state, folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(state, folder)


def test_a_model_and_optimizer_round_trip(tmp_path):
    model, optimizer = _trained()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    _save({"model": model_state, "optimizer": optimizer_state}, tmp_path)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh(torch.randn(3, 4)).sum().backward()
    fresh_optimizer.step()
    state = dict(zip(("model", "optimizer"), get_state_dict(fresh, fresh_optimizer), strict=True))
    _load(state, tmp_path)
    for name, tensor in model_state.items():
        assert torch.equal(state["model"][name], tensor), name
    group = state["optimizer"]["param_groups"][0]
    assert group["lr"] == 0.01 and tuple(group["betas"]) == (0.8, 0.9)  # non-tensor values, weights_only
    exp_avg = state["optimizer"]["state"]["0.weight"]["exp_avg"]
    assert torch.equal(exp_avg, optimizer_state["state"]["0.weight"]["exp_avg"])


def test_a_crafted_metadata_file_runs_nothing(tmp_path):
    model, _ = _trained()
    _save({"model": model.state_dict()}, tmp_path / "checkpoint")
    created = tmp_path / "pwned"
    (tmp_path / "checkpoint" / ".metadata").write_bytes(pickle.dumps(_CreatesAFile(created)))
    with pytest.raises(CheckpointError, match=r"\.metadata.*a checkpoint is data, never code"):
        read_metadata(tmp_path / "checkpoint")
    with pytest.raises(CheckpointError, match="nothing of it was run"):
        _load({"model": model.state_dict()}, tmp_path / "checkpoint")
    assert not created.exists()


def test_a_crafted_saved_object_runs_nothing(tmp_path):
    created = tmp_path / "pwned"
    _save({"weight": torch.ones(2), "extra": _CreatesAFile(created)}, tmp_path / "checkpoint")
    assert not created.exists()
    read_metadata(tmp_path / "checkpoint")  # the metadata itself is clean
    with pytest.raises(CheckpointError, match="extra"):
        _load({"weight": torch.zeros(2), "extra": None}, tmp_path / "checkpoint")
    assert not created.exists()


def test_what_dcp_writes_is_all_allowed(tmp_path):
    model, optimizer = _trained()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    _save({"model": model_state, "optimizer": optimizer_state,
           "half": torch.ones(3, dtype=torch.bfloat16), "ints": torch.arange(4)}, tmp_path)
    metadata = read_metadata(tmp_path)
    assert metadata.state_dict_metadata["half"].properties.dtype == torch.bfloat16
