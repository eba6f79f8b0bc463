"""gpt-oss: sliding-window layers beside full ones (``layer_types``), one learned sink logit per
query head joined to each head's scores, and experts with biases and a clamped SwiGLU (the
fused form, transposed; the router ``router`` beside them)."""

from fsdp_turbo.core.families.facts import Family, HeadParameter
from fsdp_turbo.core.families.registry import register_family

FAMILY = register_family(Family(
    name="gpt-oss",
    model_types=("gpt_oss",),
    head_parameters=(HeadParameter("GptOssAttention", "sinks", 0, "attention sinks"),),
))
