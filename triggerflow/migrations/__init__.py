"""Alembic environment and revisions of the native schema (``triggerflow db upgrade``)."""
