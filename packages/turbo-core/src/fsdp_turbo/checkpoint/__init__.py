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

from fsdp_turbo.checkpoint.init import init_weights, materialize
from fsdp_turbo.checkpoint.load import LoadReport, load_pretrained
from fsdp_turbo.checkpoint.save import save_pretrained
from fsdp_turbo.checkpoint.training import TrainingCheckpointer, load_training_checkpoint

__all__ = ["LoadReport", "TrainingCheckpointer", "init_weights", "load_pretrained", "load_training_checkpoint",
           "materialize", "save_pretrained"]
