"""``fsdp_turbo.utils.patch``: the upstream module API's member patcher, which is turbo-core's
(``fsdp_turbo.core.member_patch``: the same functions, one implementation)."""

from fsdp_turbo.core.member_patch import class_and_member, patch_instance, patch_model_members, resolve_callable

__all__ = ["class_and_member", "patch_instance", "patch_model_members", "resolve_callable"]
