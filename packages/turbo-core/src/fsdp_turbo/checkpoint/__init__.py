"""Hugging Face checkpoints for models of any size: build on the meta device, shard with
``FSDPTurbo``, then fill with ``load_pretrained`` (each rank reads only its slices) or
``init_weights`` (the same weights at every layout); write back with ``save_pretrained``
(transformers' own layout, without any rank holding the whole model).

```python
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config)
model = FSDPTurbo(turbo_config, model)       # nothing materialised yet
load_pretrained(model, "path/to/hf_dir")      # or init_weights(model, seed=0)
...
save_pretrained(model, "out/final")
```

Training checkpoints (the trainable parameters and their optimizer state, sharded, atomic,
optionally written in the background): ``TrainingCheckpointer`` and ``load_training_checkpoint``
(``fsdp_turbo.checkpoint.training``).
"""

import importlib
from typing import TYPE_CHECKING, Any

# Each name resolves on first use, so the small helpers here (``atomic``, ``files``) import
# without DCP and DTensor: ``fsdp-turbo train``'s launcher uses them and never trains.
_HOMES = {
    "init_weights": "init", "materialize": "init",
    "LoadReport": "load", "load_pretrained": "load",
    "save_pretrained": "save",
    "TrainingCheckpointer": "training", "load_training_checkpoint": "training",
}

__all__ = ["LoadReport", "TrainingCheckpointer", "init_weights", "load_pretrained", "load_training_checkpoint",
           "materialize", "save_pretrained"]

if TYPE_CHECKING:
    from fsdp_turbo.checkpoint.init import init_weights, materialize
    from fsdp_turbo.checkpoint.load import LoadReport, load_pretrained
    from fsdp_turbo.checkpoint.save import save_pretrained
    from fsdp_turbo.checkpoint.training import TrainingCheckpointer, load_training_checkpoint


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
