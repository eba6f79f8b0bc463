"""FSDPTurbo inside other training libraries' loops.

* :mod:`fsdp_turbo.integrations.transformers`: ``with_fsdp_turbo(Trainer)``, a subclass of
  transformers' ``Trainer`` (or of any subclass of it) that trains the model through
  ``FSDPTurbo``.

Nothing is imported here, so ``import fsdp_turbo.integrations`` costs nothing and does not
need transformers; the submodule names what is missing when it is imported.
"""
