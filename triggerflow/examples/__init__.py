"""Example triggers and operators used by the demo (not in the default allowed modules)."""
