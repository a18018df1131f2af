"""The ownership statements are written once (``store/postgres/statements/ownership.py``):
each store's statement modules hold only its rendering of the one template, and a template
cannot leave an Airflow-only parameter unnumbered. What the statements do is the contract
suite's (``tests/contract``), run against both SQL stores."""

from __future__ import annotations

import importlib

import pytest

from triggerflow.airflow.statements.bookkeeping import AIRFLOW
from triggerflow.store.postgres.statements import ownership
from triggerflow.store.postgres.statements.bookkeeping import NATIVE, Template

MODULES = {"claims", "reaper", "writer"}


def _rendering(package: str, name: str) -> str:
    holders = [m for m in MODULES
               if hasattr(importlib.import_module(f"{package}.{m}"), name)]
    assert len(holders) == 1, f"{name} in {package}: {holders}"
    return str(getattr(importlib.import_module(f"{package}.{holders[0]}"), name))


@pytest.mark.parametrize("name", sorted(ownership.TEMPLATES))
def test_each_store_runs_its_rendering_of_the_one_template(name: str) -> None:
    template = ownership.TEMPLATES[name]
    native = _rendering("triggerflow.store.postgres.statements", name)
    airflow = _rendering("triggerflow.airflow.statements", name)
    assert native == NATIVE.render(template)
    assert airflow == AIRFLOW.render(template)
    # each in its own mode's tables, with nothing of the template left unwritten
    assert "triggerflow.trigger_state" in airflow or name == "QUEUE_CONSUMERS"
    assert "trigger_state" not in native and "$D" not in airflow and "$T" not in airflow
    assert "{" not in native.replace("'{}'", "") and "{" not in airflow.replace("'{}'", "")


def test_no_template_has_a_twin_in_either_store() -> None:
    """No statement module of either store holds another copy of a template's rendering
    under another name."""
    for package in ("triggerflow.store.postgres.statements", "triggerflow.airflow.statements"):
        texts = [v for m in MODULES for v in vars(importlib.import_module(f"{package}.{m}"))
                 .values() if isinstance(v, str)]
        for template in ownership.TEMPLATES.values():
            book = NATIVE if "postgres" in package else AIRFLOW
            assert texts.count(book.render(template)) == 1


def test_an_airflow_parameter_without_a_number_is_refused() -> None:
    with pytest.raises(AssertionError, match="unnumbered parameter"):
        AIRFLOW.render(Template("SELECT 1 FROM {state} s{joined} WHERE {queue} = $1"))
    assert NATIVE.render(Template("SELECT 1 FROM {state} s WHERE {queue} = $1")) == \
        "SELECT 1 FROM trigger s WHERE s.queue = $1"
