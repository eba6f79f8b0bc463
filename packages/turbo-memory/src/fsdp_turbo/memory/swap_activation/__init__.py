"""Activation swap: offload saved activations to host memory in forward, prefetch them in backward."""

from fsdp_turbo.memory.swap_activation.mover import SwapStats
from fsdp_turbo.memory.swap_activation.swapper import ActivationSwapper, swap_activations
from fsdp_turbo.memory.swap_activation.transform import SWAPPER_ATTR, SwapActivationTransform

__all__ = ["SWAPPER_ATTR", "ActivationSwapper", "SwapActivationTransform", "SwapStats", "swap_activations"]
