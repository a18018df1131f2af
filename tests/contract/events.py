"""Events as a consumer emits them, for the contract cases."""

from __future__ import annotations

import json
import time
from typing import Any

from triggerflow.wire import Event

PAYLOAD = {"fired": "2030-01-01T00:00:00+00:00"}


def event(trigger_id: int, attempt: int, queue: str, kind: str = "resume",
          payload: Any = PAYLOAD) -> Event:
    """``payload`` is encoded as JSON unless it is already text (bad content on purpose)."""
    body = payload if isinstance(payload, str) else json.dumps(payload)
    return Event(trigger_id, attempt, queue, kind, body, time.time())
