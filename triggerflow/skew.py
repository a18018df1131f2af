"""How far this process's wall clock is from the database's, measured at each lease renewal.

Timer deadlines and trigger timeouts are instants on the database's clock (``now()`` stamps
them), but a consumer compares them with its own wall clock: one 300 s ahead fires timers
early and fails tasks with ``timeout=120`` at once. The renewal's answer carries the
database's ``clock_timestamp()``; against the wall clock read when the renewal was sent,
plus half the round trip, it gives the skew to within half the round trip. No extra
statement: the lease renews anyway.
"""

from __future__ import annotations


class ClockCheck:
    """The last skew measured (local wall clock minus the database's, seconds) and whether
    it is within ``bound`` (``max_clock_skew``)."""

    def __init__(self, bound: float) -> None:
        self.bound = bound
        self.skew: float | None = None  # None: never measured

    def measure(self, sent_wall: float, round_trip: float, db_time: float) -> None:
        """One sample: our wall clock when the renewal left, its round trip on the monotonic
        clock, the database's clock in the answer. A round trip longer than the bound says
        too little (the error is up to half of it): the last estimate stands."""
        if 0 <= round_trip <= self.bound:
            self.skew = sent_wall + round_trip / 2 - db_time

    @property
    def ok(self) -> bool:
        return self.skew is not None and abs(self.skew) <= self.bound

    def problem(self) -> str | None:
        """Why our clock may not time triggers, or None (what readiness reports)."""
        if self.skew is None:
            return "clock not yet compared with the database's"
        if abs(self.skew) > self.bound:
            return (
                f"clock {self.skew:+.1f}s off the database's "
                f"(max_clock_skew {self.bound:g}s): not running triggers"
            )
        return None
