"""`triggerflow demo` and what it runs: example operators and triggers and a reference host.

Installed with triggerflow (the README's first command needs nothing else) but outside the
runtime package: nothing in ``triggerflow`` imports it except the CLI's ``demo`` command.
Keep this module empty: the demo's consumers import ``triggerflow_demo.triggers``.
"""
