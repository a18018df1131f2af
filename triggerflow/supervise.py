"""Running ``triggerflow`` CLI processes as children: one helper for the demo, the bench and
the tests. Each child logs to its own file; stopping sends a signal, waits out a grace
period, then kills, so nothing outlives its owner."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from triggerflow.settings import Settings

Child = subprocess.Popen[bytes]


def child_env(settings: Settings, *, pythonpath: str | None = None,
              **overrides: Any) -> dict[str, str]:
    """This environment minus any ``TRIGGERFLOW_*``, plus exactly ``settings`` (and
    ``overrides``) as ``TRIGGERFLOW_*`` variables; ``pythonpath`` goes first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIGGERFLOW_")}
    env.update(settings.as_env(**overrides))
    env["PYTHONUNBUFFERED"] = "1"
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    return env


class Supervisor:
    """Starts ``python -m triggerflow ARGS`` children with logs in ``logdir``."""

    def __init__(self, logdir: Path, *, cwd: Path | None = None) -> None:
        self.logdir = logdir
        self.cwd = cwd
        self.children: list[Child] = []
        self._logs: dict[int, Path] = {}

    def start(self, *args: str, env: Mapping[str, str], name: str | None = None) -> Child:
        path = self.logdir / f"{len(self.children) + 1:03d}-{name or args[0]}.log"
        with open(path, "wb") as log:  # the child keeps its own copy of the descriptor
            child = subprocess.Popen([sys.executable, "-m", "triggerflow", *args], env=dict(env),
                                     stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd)
        self.children.append(child)
        self._logs[child.pid] = path
        return child

    def log_path(self, child: Child) -> Path:
        return self._logs[child.pid]

    def log(self, child: Child) -> str:
        return self._logs[child.pid].read_text(errors="replace")

    def stop(self, child: Child, sig: int = signal.SIGTERM, grace: float = 20.0) -> None:
        """Signal (a stopped child is continued first), wait ``grace`` seconds, then kill."""
        self.stop_all([child], sig, grace)

    async def stop_async(self, child: Child, sig: int = signal.SIGTERM,
                         grace: float = 20.0) -> None:
        await asyncio.to_thread(self.stop, child, sig, grace)

    def stop_all(self, children: list[Child] | None = None, sig: int = signal.SIGTERM,
                 grace: float = 20.0) -> None:
        """Signal every live child at once, then wait for all within one ``grace`` period."""
        targets = list(self.children if children is None else children)
        for child in targets:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGCONT)
                    child.send_signal(sig)
        deadline = time.monotonic() + grace
        for child in targets:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
