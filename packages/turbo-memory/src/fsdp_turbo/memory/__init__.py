"""turbo-memory: FSDPTurbo's memory-saving techniques.

Each is a transform the facade applies from the config, and a plain API usable on
any model without the facade:

- recompute: ``apply_recompute(modules, policy='full'|'selective'|[ops])``
- chunked batch: ``apply_chunk_batch(modules, num_chunks)``
- chunked loss: ``chunked_cross_entropy(hidden, weight, labels)``, ``install_chunked_loss(model)``
- activation swap: ``ActivationSwapper(modules)`` / ``swap_activations(modules)``
- optimizer-state swap: ``swap_optimizer_states(optimizer)``
"""

__version__ = "0.1.0"

from fsdp_turbo.memory.chunk_batch import apply_chunk_batch
from fsdp_turbo.memory.chunk_loss import chunked_cross_entropy, install_chunked_loss
from fsdp_turbo.memory.recompute import apply_recompute
from fsdp_turbo.memory.swap_activation import ActivationSwapper, swap_activations
from fsdp_turbo.memory.swap_optimizer import swap_optimizer_states

__all__ = ["ActivationSwapper", "__version__", "apply_chunk_batch", "apply_recompute", "chunked_cross_entropy",
           "install_chunked_loss", "swap_activations", "swap_optimizer_states"]
