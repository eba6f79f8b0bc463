"""Training checkpoints (``fsdp_turbo.checkpoint.training``) on 2 gloo ranks, FSDP=2, float32:
a save written in the background while training changes the weights holds the weights of its own
step, exactly as a synchronous save of that step does; a background failure on one rank is raised
on every rank; a folder appears only complete."""

import pytest
import torch

from fsdp_turbo.core.testing import run_distributed
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.core.testing.parity import make_token_batches

pytestmark = pytest.mark.multirank
WORLD = 2
BATCHES = make_token_batches(vocab_size=256, global_batch=4, seq_len=16, steps=4)


def _model_and_optimizer():
    # torch's fully_shard itself: turbo-core is tested without turbo-distributed installed
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = tiny_hf_causal_lm("llama")
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def _step(model, optimizer, batch) -> None:
    import torch.distributed as dist

    rows = batch.chunk(WORLD)[dist.get_rank()]
    model(input_ids=rows, labels=rows).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _state(model, optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of the weights and of AdamW's moments, copied."""
    from torch.distributed.tensor import DTensor

    local = lambda t: (t.to_local() if isinstance(t, DTensor) else t).detach().clone()  # noqa: E731
    out = {f"w {n}": local(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key} {n}"] = local(optimizer.state[p][key])
    return out


def _save_in_background_and_train_on(root: str) -> dict:
    from pathlib import Path

    from fsdp_turbo.checkpoint import TrainingCheckpointer, load_training_checkpoint

    model, optimizer = _model_and_optimizer()
    background, now = TrainingCheckpointer(async_save=True), TrainingCheckpointer()
    for batch in BATCHES[:2]:
        _step(model, optimizer, batch)
    at_step_2 = _state(model, optimizer)
    background.save(f"{root}/background/step-2", model, optimizer, {"step": 2})
    in_flight = background.in_flight
    now.save(f"{root}/now/step-2", model, optimizer, {"step": 2})
    for batch in BATCHES[2:]:  # the weights change while step 2 is written
        _step(model, optimizer, batch)
    background.close()
    folders = sorted(p.name for p in Path(root, "background").iterdir())
    loaded = {}
    for kind in ("background", "now"):
        fresh, fresh_optimizer = _model_and_optimizer()
        _step(fresh, fresh_optimizer, BATCHES[3])  # other values, and AdamW's state to load into
        meta = load_training_checkpoint(f"{root}/{kind}/step-2", fresh, fresh_optimizer)
        loaded[kind] = (meta, _state(fresh, fresh_optimizer))
    return {"at_step_2": at_step_2, "loaded": loaded, "in_flight": str(in_flight), "folders": folders}


def test_a_background_save_holds_its_steps_weights_while_training_goes_on(tmp_path):
    for rank in run_distributed(_save_in_background_and_train_on, WORLD, str(tmp_path), timeout=300):
        assert rank["in_flight"] == str(tmp_path / "background" / "step-2")
        assert rank["folders"] == ["step-2"]  # complete, and no partial folder left
        for kind in ("background", "now"):
            meta, state = rank["loaded"][kind]
            assert meta == {"step": 2}
            assert state.keys() == rank["at_step_2"].keys()
            for name, value in rank["at_step_2"].items():
                torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=f"{kind}: {name}")


def _fail_in_the_background_on_rank_1(root: str) -> None:
    import torch.distributed as dist

    from fsdp_turbo.checkpoint import TrainingCheckpointer

    def disk_full() -> None:
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")

    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, BATCHES[0])
    saver = TrainingCheckpointer(async_save=True)
    saver.save(f"{root}/step-1", model, optimizer, {"step": 1}, before_complete=disk_full)
    _step(model, optimizer, BATCHES[1])
    saver.wait()


def test_a_background_failure_on_one_rank_is_raised_on_every_rank_and_leaves_no_checkpoint(tmp_path):
    errors = run_distributed(_fail_in_the_background_on_rank_1, WORLD, str(tmp_path), timeout=300,
                             return_exceptions=True)
    assert isinstance(errors[1], OSError)  # the failing rank raises its own error, the other rank's names it
    assert "step-1: rank 1 failed" in str(errors[0])
    for error in errors:
        assert "No space left on device" in str(error), error
    assert not (tmp_path / "step-1").exists() and (tmp_path / "step-1.partial").is_dir()
