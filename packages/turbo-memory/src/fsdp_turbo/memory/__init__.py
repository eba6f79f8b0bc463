"""turbo-memory: FSDPTurbo's memory-saving transforms.

Selective recompute, chunked loss, activation swap and optimizer-state swap land
here (issue 4); this release ships the package skeleton only.
"""

__version__ = "0.1.0"
