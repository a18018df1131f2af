"""Turns a claimed :class:`~triggerflow.store.TriggerSpec` into a trigger object, or says why not.

The allow-list is checked on the string before anything is imported. Kwargs arrive decoded
by the store (each mode stores them its own way), or with the reason they could not be.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from triggerflow.errors import TriggerflowError
from triggerflow.model import is_allowed
from triggerflow.store.interface import KwargsProblem, TriggerSpec
from triggerflow.triggers.base import BaseTrigger


class Disallowed(TriggerflowError):
    """The class is outside the allowed modules or is not a BaseTrigger: fail the task."""


class Unloadable(TriggerflowError):
    """This process cannot import the class (maybe another consumer's newer code can)."""


class BadKwargs(TriggerflowError):
    """The stored kwargs do not build the class: fail the task."""


class Loader(Protocol):
    """What the consumer needs of a loader (native: ``TriggerLoader``; Airflow mode:
    ``triggerflow.airflow.loader.AirflowLoader``)."""

    def build(self, spec: TriggerSpec) -> BaseTrigger: ...


class AllowedClasses:
    """The allow-list and class cache every loader shares: ``resolve`` checks the classpath
    before anything is imported, ``instantiate`` builds from a claimed spec's kwargs. A loader
    says how a classpath becomes a class (``load``)."""

    def __init__(self, allowed_modules: list[str]) -> None:
        self.allowed_modules = allowed_modules
        self._classes: dict[str, type[Any]] = {}

    def load(self, classpath: str) -> type[Any]:
        raise NotImplementedError

    def resolve(self, classpath: str) -> type[Any]:
        cls = self._classes.get(classpath)
        if cls is not None:
            return cls
        if not is_allowed(classpath, self.allowed_modules):
            raise Disallowed(
                f"trigger class {classpath!r} is not in the allowed modules "
                f"{self.allowed_modules}"
            )
        cls = self.load(classpath)
        self._classes[classpath] = cls
        return cls

    def instantiate(self, spec: TriggerSpec) -> Any:
        cls = self.resolve(spec.classpath)
        problem = spec.kwargs_error
        if problem is not None:
            if problem.problem is KwargsProblem.UNREADABLE_HERE:
                raise Unloadable(f"cannot decrypt kwargs of {spec.classpath}: {problem.message}")
            raise BadKwargs(f"kwargs do not build {spec.classpath}: {problem.message}")
        try:
            return cls(**(spec.kwargs or {}))
        except Exception as exc:
            raise BadKwargs(f"kwargs do not build {spec.classpath}: {exc!r}") from exc


class TriggerLoader(AllowedClasses):
    """Resolves allowed classes (cached) and builds triggers from claimed specs.

    ``build`` raises :class:`Disallowed` (fail the task), :class:`Unloadable` (another
    consumer may load it) or :class:`BadKwargs` (fail the task).
    """

    def load(self, classpath: str) -> type[BaseTrigger]:
        module_name, _, name = classpath.rpartition(".")
        try:
            module = importlib.import_module(module_name)
            found = getattr(module, name)
        except (ImportError, AttributeError) as exc:
            raise Unloadable(f"cannot import trigger class {classpath!r}: {exc}") from exc
        if not (isinstance(found, type) and issubclass(found, BaseTrigger)):
            raise Disallowed(f"{classpath!r} is not a BaseTrigger subclass")
        return found

    def build(self, spec: TriggerSpec) -> BaseTrigger:
        trigger: BaseTrigger = self.instantiate(spec)
        return trigger
