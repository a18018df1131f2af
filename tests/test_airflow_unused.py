"""UnusedTriggers: applied batches' trigger rows are cleaned after the burst, not inside it."""

from __future__ import annotations

import asyncio

from tests.conftest import wait_until
from triggerflow.airflow.unused import UnusedTriggers


async def test_no_clean_while_a_batch_is_being_applied() -> None:
    """A batch that takes longer than ``quiet`` is still the burst: its neighbour's clean
    waits for it (in ``bench airflow`` a clean of 1,000 rows ran beside the next batch)."""
    cleaned: list[list[int]] = []
    applying = True

    async def clean(ids: list[int]) -> None:
        cleaned.append(ids)

    unused = UnusedTriggers(clean, quiet=0.05, longest=60.0, busy=lambda: applying)
    unused.add([3, 1, 2])
    await asyncio.sleep(0.5)  # ten times quiet, the batch still in hand
    assert cleaned == []
    applying = False

    async def done() -> bool:
        return bool(cleaned)

    await wait_until(done, 10, interval=0.02, message="the clean after the burst")
    assert cleaned == [[1, 2, 3]]
    await unused.close()


async def test_a_batch_always_in_hand_is_cleaned_after_longest() -> None:
    cleaned: list[list[int]] = []

    async def clean(ids: list[int]) -> None:
        cleaned.append(ids)

    unused = UnusedTriggers(clean, quiet=0.05, longest=0.3, busy=lambda: True)
    unused.add([5])

    async def done() -> bool:
        return bool(cleaned)

    await wait_until(done, 10, interval=0.02, message="the clean after longest")
    assert cleaned == [[5]]
    await unused.close()
