"""How a quantized layer quantizes: format, block, scale mode, and the element emax per role."""

from __future__ import annotations

from dataclasses import dataclass

# HiF8's 3-bit-mantissa region is |exponent| <= 3, so activations and weights aim their
# block max at [8, 16); gradients have a wider spread and aim at 224 (emax 7).
HIF8_GRADIENT_EMAX = 7


@dataclass(frozen=True)
class MXRecipe:
    quant_format: str = "E4M3"
    block_size: int = 32
    scale_mode: str = "floor"
    emax_elem: int | None = None
    grad_emax_elem: int | None = None

    @classmethod
    def from_config(cls, plan) -> MXRecipe:
        """From a ``QuantizeConfig`` (duck-typed, so the recipe needs no config import)."""
        grad_emax = plan.emax_elem
        if plan.quant_format == "HIF8" and grad_emax is None:
            grad_emax = HIF8_GRADIENT_EMAX
        return cls(plan.quant_format, plan.block_size, plan.scale_mode, plan.emax_elem, grad_emax)

    def emax(self, *, gradient: bool) -> int | None:
        return self.grad_emax_elem if gradient else self.emax_elem
