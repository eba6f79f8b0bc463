"""Parameters stored in another form than their values, and how checkpoints see through them.

QLoRA-MX (turbo-quant's ``store_frozen_weights``) keeps a frozen weight as packed MX bytes,
so the live parameter is neither the shape nor the dtype of the weight a checkpoint holds.
A module that stores a parameter so says it in ``module.stored_forms``: ``{parameter name:
StoredForm}``. Checkpoint code reads and writes values: ``load_pretrained`` and
``init_weights`` encode the values of each rank's box, ``save_pretrained`` decodes what it
gathers. This package needs no knowledge of MX to do so.

A form must be blockwise: a box of the stored tensor that starts and ends on block edges
holds exactly the encoding of one box of the values (``values_box`` maps one to the
other). Sharding only ever cuts a stored tensor on block edges (the module that packs it
makes sure of that), so each rank encodes and decodes its own shard alone.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from fsdp_turbo.checkpoint.shards import LocalBox
from fsdp_turbo.core.stage_part import stage_parts

STORED_FORMS_ATTR = "stored_forms"


@runtime_checkable
class StoredForm(Protocol):
    """How one parameter is stored when that is not its values."""

    values_dtype: torch.dtype  # the dtype of the values (the weight as the model was built)

    def values_box(self, start: tuple[int, ...], size: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The box of the values a box (start, size) of the stored tensor holds."""
        ...

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The stored form of a box of values (whole blocks)."""
        ...

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The values, in ``dtype``, of a box of the stored tensor (whole blocks)."""
        ...


def stored_forms(model: nn.Module) -> dict[str, StoredForm]:
    """Every stored-form parameter of ``model`` by qualified name (the names ``local_tensors`` uses)."""
    found = {}
    for part in stage_parts(model):
        for module_name, module in part.named_modules():
            prefix = f"{module_name}." if module_name else ""
            for name, form in getattr(module, STORED_FORMS_ATTR, {}).items():
                found[prefix + name] = form
    return found


class ValuesBox:
    """A box of values to fill for a stored-form parameter: ``box`` is host-side staging in the
    values' shape and dtype; ``commit`` encodes it into the stored shard. For a plain
    parameter ``box`` is the shard itself and ``commit`` does nothing."""

    def __init__(self, stored: LocalBox, form: StoredForm | None) -> None:
        self._stored, self._form = stored, form
        if form is None:
            self.box = stored
            return
        start, size = form.values_box(stored.start, stored.size)
        staging = torch.empty(size, dtype=form.values_dtype, device=stored.tensor.device)
        self.box = LocalBox(staging, start, size)

    def commit(self) -> None:
        if self._form is not None:
            with torch.no_grad():
                self._stored.tensor.copy_(self._form.encode(self.box.tensor))
