"""Bounded retrying while the broker or the database refuses our credentials.

A database or broker that is down comes back; a wrong password, an unknown user or a virtual
host this user may not open does not (unless a secret is being rotated). So a refusal is
retried ``ACCESS_ATTEMPTS`` times in a row, each logged, and then ends the process with one
line; any other failure is retried as long as it lasts. Imports nothing of ours, so the store
side and the transport side both use it.
"""

from __future__ import annotations

import logging
from typing import Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    retry_if_not_exception_type,
)

ACCESS_ATTEMPTS = 6  # tries while refused (not ready, not counted as capacity), then exit

ExceptionTypes = type[BaseException] | tuple[type[BaseException], ...]


class Refusals:
    """Counts consecutive refusals (``refused`` errors) of ``service``; a tenacity policy.

    ``last_error`` says why the latest attempt failed, for readiness; :meth:`reset` after a
    success.
    """

    def __init__(self, service: str, refused: ExceptionTypes, log: logging.Logger, *,
                 unavailable_attempts: int | None = None) -> None:
        self.service = service
        self.refused = refused
        self.log = log
        # Other failures are retried as long as they last, or this many times in a row.
        self.unavailable_attempts = unavailable_attempts
        self.count = 0
        self.unavailable = 0
        self.last_error: str | None = None

    def reset(self) -> None:
        self.count, self.unavailable, self.last_error = 0, 0, None

    def retrying(self, retry_on: ExceptionTypes, wait: Any,
                 never: ExceptionTypes = ()) -> AsyncRetrying:
        """Retry ``retry_on`` but not ``never`` with ``wait``; give up (re-raising) after too
        many refusals."""
        retry = retry_if_exception_type(retry_on) & retry_if_not_exception_type(never)
        return AsyncRetrying(retry=retry, stop=self._stop, wait=wait,
                             before_sleep=self._before_sleep, reraise=True)

    def _stop(self, state: RetryCallState) -> bool:
        exc = state.outcome.exception() if state.outcome else None
        self.last_error = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, self.refused):
            self.unavailable += 1
            return self.unavailable_attempts is not None and \
                self.unavailable >= self.unavailable_attempts
        self.count += 1
        return self.count >= ACCESS_ATTEMPTS

    def _before_sleep(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0.0
        if isinstance(exc, self.refused):
            self.log.error("%s refused our credentials (attempt %d of %d): %s; retrying in %.1fs",
                           self.service, self.count, ACCESS_ATTEMPTS, exc, wait)
        else:
            self.log.warning("%s is unavailable (%s); retrying in %.1fs", self.service,
                             self.last_error, wait)
