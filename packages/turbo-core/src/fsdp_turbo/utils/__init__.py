"""The upstream FSDPTurbo's module-level helpers that clients import by path
(LLaMA-Factory's ``fsdpturbo`` backend): thin, documented layers over turbo-core."""
