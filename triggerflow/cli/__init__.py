"""The ``triggerflow`` command line.

``options`` derives flags and env vars from the Settings model; ``commands`` holds the group,
set-up and service commands; ``status``, ``admin`` and ``tools`` add the operator commands.
"""

from triggerflow.cli.commands import main

__all__ = ["main"]
