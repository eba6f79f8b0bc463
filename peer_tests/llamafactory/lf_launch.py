"""The torchrun entry of the LLaMA-Factory peer test: runs the client's own v1 SFT command
(``llamafactory.v1.launcher.main``, what ``llamafactory-cli sft CONFIG`` runs on each rank).

    torchrun --nproc-per-node N lf_launch.py CONFIG.yaml [--probe PROBE.json]

Two things of ours, nothing of the client's changed:

* ``torch.accelerator.synchronize`` becomes a no-op where torch has no accelerator. The client
  calls it after every optimizer step (``DistributedInterface.sync``); on a CPU-only torch it
  raises, since there is no accelerator to synchronize. That is the client's gap (it assumes a
  device), not FSDPTurbo's, and the one call this launcher may neutralize.
* ``--probe``: before training, with the client's own distributed state set up from the same
  config, it shards a second copy of the model through the client's ``fsdpturbo`` plugin in
  bf16 and writes what it observed (the expert meshes, the storage dtypes, the expert
  gradients' divide factor) to a JSON file, one entry per rank. Training then runs as usual:
  ``run_sft`` parses the config again and reseeds, so the probe does not move its numbers.

The worker ends through ``fsdp_turbo.core.device.end_process`` (no interpreter teardown, where
gloo's threads kept alive by FSDP states abort a finished worker: pytorch/pytorch#179291).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from fsdp_turbo.core.device import end_process


def _accelerator_synchronize_on_cpu() -> None:
    """Make ``torch.accelerator.synchronize`` a no-op when there is no accelerator (see the module
    docstring: the client's gap). Where one exists, the real call stays."""
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.synchronize = lambda device=None: None


def _mesh_facts(mesh: Any) -> dict[str, Any] | None:
    if mesh is None:
        return None
    return {"shape": list(mesh.shape), "names": list(mesh.mesh_dim_names)}


def _param_facts(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Every parameter's storage dtype and, for a DTensor, its mesh's dimension names."""
    facts = {}
    for name, param in model.named_parameters():
        mesh = getattr(param, "device_mesh", None)
        facts[name] = {"dtype": str(param.dtype).removeprefix("torch."),
                       "mesh": list(mesh.mesh_dim_names) if mesh is not None else None}
    return facts


def _probe(config: str) -> dict[str, Any]:
    """Shard a fresh model through the client's fsdpturbo plugin (bf16 on), in the client's own
    distributed state, and record what the expert topology and the storage came out as."""
    from llamafactory.v1.accelerator.interface import DistributedInterface
    from llamafactory.v1.config import get_args
    from llamafactory.v1.core.model_engine import ModelEngine
    from llamafactory.v1.plugins.trainer_plugins.distributed.fsdpturbo import get_fsdpturbo_parallel_state
    from llamafactory.v1.plugins.trainer_plugins.distributed.interface import DistributedPlugin

    model_args, _, training_args, _ = get_args(yaml.safe_load(Path(config).read_text()))
    DistributedInterface(training_args)
    model = ModelEngine(model_args, is_train=True).model
    sharded = DistributedPlugin("fsdpturbo").shard_model(model, training_args.dist_config, bf16=True)
    state = get_fsdpturbo_parallel_state()
    return {
        "rank": dist.get_rank(),
        "sizes": {"dp": state.dp_size, "ep": state.ep_size, "efsdp": state.efsdp_size, "edp": state.edp_size},
        "expert_mesh": _mesh_facts(state.expert_mesh),
        "sub_meshes": {name: _mesh_facts(getattr(state, f"{name}_mesh"))
                       for name in ("edp", "efsdp", "ep", "expert_cp")},
        "params": _param_facts(sharded),
    }


def _gather_to_file(record: dict[str, Any], path: Path) -> None:
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        path.write_text(json.dumps(records, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the client's SFT YAML")
    parser.add_argument("--probe", type=Path, help="where to write the probe's JSON (fsdpturbo configs only)")
    args = parser.parse_args()
    _accelerator_synchronize_on_cpu()
    # The client reads its config from argv (llamafactory-cli sft CONFIG): leave it exactly that.
    sys.argv = [sys.argv[0], "sft", args.config]
    if args.probe is not None:
        _gather_to_file(_probe(args.config), args.probe)
    from llamafactory.v1.launcher import main as client_main

    client_main()
    end_process(0)


if __name__ == "__main__":
    main()
