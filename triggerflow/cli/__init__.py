"""The ``triggerflow`` command line.

``commands`` holds the root group, which imports a command's module when it runs;
``options`` derives flags and env vars from the Settings model; ``failures`` turns what a
command raises into one line; ``services``, ``status``, ``admin`` and ``tools`` hold the
commands.
"""

from triggerflow.cli.commands import main

__all__ = ["main"]
