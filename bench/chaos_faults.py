"""The processes of ``triggerflow bench chaos`` and the nemesis that hits them: each fault is
caused for real and recorded with its time, its kind and a witness that it happened (a
killed process's exit status and its replacement's pid, ``T`` in ``/proc`` for a stopped
one, the postmaster's new pid, backends terminated, events published again; with
``--topology cluster`` the promoted standby out of recovery on a new timeline, the stopped
broker node missing from the cluster's running nodes)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.chaos_bad import BAD_HEADER, bad_messages, bad_triggers
from bench.chaos_plan import SLOTS, Fault

if TYPE_CHECKING:
    import aio_pika

    from bench.chaos_cluster import Cluster
    from bench.common import Proc
    from bench.harness import Bench
    from testbed.services import PostgresCluster


@dataclass
class Slot:
    name: str
    queue: str | None  # a consumer's team queue; None for a writer
    proc: Proc | None = None
    busy: bool = False  # under a fault: the watcher leaves it alone
    pids: list[int] = field(default_factory=list)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


@dataclass
class Fleet:
    """Two consumers per team queue and two writers, restarted as a supervisor would."""

    b: Bench
    queues: dict[str, str]  # team -> queue
    slots: dict[str, Slot] = field(default_factory=dict)
    exits: list[dict[str, Any]] = field(default_factory=list)  # exits nobody caused

    def __post_init__(self) -> None:
        for name in SLOTS:
            queue = self.queues[name[0]] if name[0] != "w" else None
            self.slots[name] = Slot(name, queue)

    def start(self, slot: Slot, skew: float = 0.0) -> None:
        if slot.queue is None:
            slot.proc = self.b.start("writer")
        elif skew:
            slot.proc = self._start_skewed(slot.queue, skew)
        else:
            slot.proc = self.b.start("consume", "--queue", slot.queue)
        slot.pids.append(slot.proc.pid)

    def _start_skewed(self, queue: str, skew: float) -> Proc:
        """A consumer whose ``time.time`` is ``skew`` s off, by a ``sitecustomize`` first on
        its path (as ``tests/test_clock_skew.py``): the machine's clock stays."""
        from bench.common import Proc

        site = self.b.out / f"skew{skew:+.1f}"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(
            f"import time\n\n_real = time.time\ntime.time = lambda: _real() + {skew!r}\n")
        env = self.b.env("consumer")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
        assert self.b.supervisor is not None  # start_all started the others through it
        popen = self.b.supervisor.start("consume", "--queue", queue, env=env,
                                        name="consume-skewed")
        proc = Proc("consume", popen, self.b.supervisor.log_path(popen), "consumer")
        self.b.procs.append(proc)
        return proc

    async def start_all(self, within: float = 120) -> None:
        for slot in self.slots.values():
            self.start(slot)
        assert self.b.broker is not None
        want = {q: 2 for q in self.queues.values()} | {self.b.broker.topology.events_queue: 2}
        deadline = time.monotonic() + within
        for queue, n in want.items():
            while await self.b.broker_consumers(queue) < n:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fewer than {n} consumers on {queue} after {within}s")
                await asyncio.sleep(0.2)

    async def watch(self) -> None:
        """Restart a process that exited by itself (no fault of ours), and record it."""
        while True:
            await asyncio.sleep(0.5)
            for slot in self.slots.values():
                if slot.busy or slot.proc is None or slot.proc.alive():
                    continue
                self.exits.append({"at": time.time(), "slot": slot.name, "pid": slot.proc.pid,
                                   "returncode": slot.proc.popen.returncode,
                                   "log": str(slot.proc.log)})
                self.b.log(f"[yellow]{slot.name} (pid {slot.proc.pid}) exited by itself "
                           f"with {slot.proc.popen.returncode}; see {slot.proc.log}")
                self._forget(slot.proc)
                self.start(slot)

    def _forget(self, proc: Proc) -> None:
        if proc in self.b.procs:
            self.b.procs.remove(proc)

    async def signal_out(self, slot: Slot, sig: signal.Signals, down: float) -> dict[str, Any]:
        """SIGKILL or SIGTERM, wait for the exit, stay down ``down`` s, start a replacement."""
        proc = slot.proc
        if proc is None or not proc.alive() or slot.busy:
            return {"skipped": "target down or under another fault"}
        slot.busy = True
        try:
            code = await self._stop(proc, sig)
            await asyncio.sleep(down)
            self.start(slot)
            assert slot.proc is not None
            return {"pid": proc.pid, "returncode": code, "new_pid": slot.proc.pid}
        finally:
            slot.busy = False

    async def skewed(self, slot: Slot, skew: float, seconds: float) -> dict[str, Any]:
        """Restart a consumer with its clock ``skew`` s off for ``seconds``, then with a good
        clock again; the witness is the skew its own renewals measured (``consumer`` row)."""
        proc = slot.proc
        if proc is None or not proc.alive() or slot.busy or slot.queue is None:
            return {"skipped": "target down or under another fault"}
        slot.busy = True
        try:
            first = await self._stop(proc, signal.SIGTERM)
            self.start(slot, skew)
            assert slot.proc is not None
            skewed, measured = slot.proc, None
            # skewed for ``seconds``, and on until its first renewal measured the skew (a
            # loaded machine starts a process slowly), for 30 s more at most
            until, latest = time.monotonic() + seconds, time.monotonic() + seconds + 30
            while time.monotonic() < (until if measured is not None else latest):
                await asyncio.sleep(0.5)
                if not skewed.alive():
                    break
                with contextlib.suppress(Exception):  # PostgreSQL may be restarting
                    value = await self.b.db().fetchval(
                        "SELECT clock_skew FROM consumer WHERE pid = $1", skewed.pid)
                    measured = measured if value is None else float(value)
            alive = skewed.alive()
            await self._stop(skewed, signal.SIGTERM)
            self.start(slot)
            assert slot.proc is not None
            return {"pid": proc.pid, "returncode": first, "skewed_pid": skewed.pid,
                    "skew": skew, "clock_skew": measured, "alive_while_skewed": alive,
                    "new_pid": slot.proc.pid}
        finally:
            slot.busy = False

    async def _stop(self, proc: Proc, sig: signal.Signals) -> int | None:
        proc.popen.send_signal(sig)
        try:
            code = await asyncio.to_thread(proc.popen.wait, 30)
        except Exception:  # a SIGTERM that did not end it: as a supervisor would
            proc.popen.kill()
            code = await asyncio.to_thread(proc.popen.wait, 10)
        self._forget(proc)
        return code

    async def freeze(self, slot: Slot, seconds: float) -> dict[str, Any]:
        proc = slot.proc
        if proc is None or not proc.alive() or slot.busy:
            return {"skipped": "target down or under another fault"}
        slot.busy = True
        try:
            proc.popen.send_signal(signal.SIGSTOP)
            await asyncio.sleep(0.1)
            state = _state(proc.pid)
            await asyncio.sleep(max(0.0, seconds - 0.1))
            proc.popen.send_signal(signal.SIGCONT)
            return {"pid": proc.pid, "state_while_stopped": state}
        finally:
            slot.busy = False

    async def thaw_all(self) -> None:
        for slot in self.slots.values():
            if slot.proc is not None and slot.proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.popen.send_signal(signal.SIGCONT)


@dataclass
class EventTap:
    """A queue of the bench's own on the events exchange: the events published lately, to
    deliver again (duplicates and replays of events already applied or fenced)."""

    url: str
    exchange: str
    seen: collections.deque[tuple[str, bytes]] = field(
        default_factory=lambda: collections.deque(maxlen=500))
    conn: aio_pika.abc.AbstractRobustConnection | None = None

    async def start(self) -> None:
        import aio_pika

        self.conn = await aio_pika.connect_robust(self.url)
        ch = await self.conn.channel()
        exchange = await ch.get_exchange(self.exchange)
        queue = await ch.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(exchange, "#")

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with message.process():
                if BAD_HEADER not in (message.headers or {}):  # bad input is judged apart
                    self.seen.append((message.routing_key or "", message.body))

        await queue.consume(on_message)

    async def replay(self, rng: random.Random, share: float) -> dict[str, Any]:
        import aio_pika

        if self.conn is None or not self.seen:
            return {"skipped": "no event seen yet"}
        picked = rng.sample(list(self.seen), max(1, int(len(self.seen) * share / 4)))
        ch = await self.conn.channel()
        try:
            exchange = await ch.get_exchange(self.exchange)
            for key, body in picked:
                await exchange.publish(aio_pika.Message(body, delivery_mode=2), key)
        finally:
            await ch.close()
        return {"published_again": len(picked)}

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()


async def restart_postgres(cluster: PostgresCluster) -> dict[str, Any]:
    def pid() -> int:
        return int((cluster.data / "postmaster.pid").read_text().split()[0])

    before = pid()
    await asyncio.to_thread(cluster.restart)
    return {"postmaster_pid": before, "new_postmaster_pid": pid()}


async def terminate_backends(admin_dsn: str, roles: list[str], share: float) -> dict[str, Any]:
    """Close, from the server's side, ``share`` of the connections of these login roles."""
    import asyncpg

    conn = await asyncpg.connect(admin_dsn)
    try:
        pids = [r["pid"] for r in await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE usename = ANY($1::text[]) "
            "AND datname = current_database()", roles)]
        victims = pids[:max(1, round(len(pids) * share))] if pids else []
        done = sum([bool(await conn.fetchval("SELECT pg_terminate_backend($1)", p))
                    for p in victims])
    finally:
        await conn.close()
    return {"roles": roles, "connections": len(pids), "terminated": done}


async def cause(fault: Fault, fleet: Fleet, tap: EventTap, cluster: PostgresCluster,
                rng: random.Random, t0: float, servers: Cluster | None = None) -> dict[str, Any]:
    """Cause ``fault`` now; its record: times (epoch), kind, target, witness, happened.
    ``servers``: ``--topology cluster``'s, which cause its own kinds and ``pg_restart``."""
    at = time.time()
    slot = fleet.slots.get(fault.slot)
    b = fleet.b
    witness: dict[str, Any]
    inputs: list[dict[str, Any]] = []  # bad input: each piece, for the checker
    try:
        if fault.kind.endswith("_kill") and slot is not None:
            witness = await fleet.signal_out(slot, signal.SIGKILL, fault.seconds)
        elif fault.kind.endswith("_term") and slot is not None:
            witness = await fleet.signal_out(slot, signal.SIGTERM, fault.seconds)
        elif fault.kind.endswith("_stop") and slot is not None:
            witness = await fleet.freeze(slot, fault.seconds)
        elif servers is not None and fault.kind in ("pg_restart", "pg_promote",
                                                    "rabbit_node_stop"):
            witness = await servers.cause(fault)
        elif fault.kind == "pg_restart":
            witness = await restart_postgres(cluster)
        elif fault.kind == "pg_terminate":
            roles = [f"tfbench_{r}" for r in fault.roles]  # Bench's login roles
            witness = await terminate_backends(b.admin_dsn, roles, fault.share)
        elif fault.kind == "replay":
            witness = await tap.replay(rng, fault.share)
        elif fault.kind == "consumer_skew" and slot is not None:
            witness = await fleet.skewed(slot, fault.skew, fault.seconds)
        elif fault.kind == "bad_message":
            witness, inputs = await bad_messages(fault, fleet, tap)
        elif fault.kind == "bad_trigger":
            witness, inputs = await bad_triggers(fault, fleet)
        else:
            witness = {"skipped": f"unknown kind {fault.kind}"}
    except Exception as exc:  # recorded: a fault that could not be caused is not counted
        witness = {"error": repr(exc)}
    return {"kind": fault.kind, "planned": fault.at, "at": at, "end": time.time(),
            "offset": at - t0, "target": fault.slot, "witness": witness, "inputs": inputs,
            "happened": happened(fault.kind, witness)}


def happened(kind: str, w: dict[str, Any]) -> bool:
    """Did the witness see the fault take effect?"""
    if "skipped" in w or "error" in w:
        return False
    if kind == "consumer_skew":  # its renewals saw the clock off past max_clock_skew (2 s)
        return w.get("clock_skew") is not None and abs(w["clock_skew"]) > 2.0
    if kind.startswith("bad_"):
        return bool(w["sent"] or w["refused_at_publish"])
    if kind == "pg_promote":  # the standby left recovery on a timeline of its own
        return (w["in_recovery_before"] is True and w["in_recovery_after"] is False
                and w["timeline_after"] > w["timeline_before"])
    if kind == "rabbit_node_stop":  # gone from the cluster's running nodes, then back
        return w["node"] not in w["running_while_stopped"] and w["node"] in w["running_after"]
    if kind.endswith(("_kill", "_term")):
        return w.get("returncode") is not None and w.get("new_pid") != w.get("pid")
    if kind.endswith("_stop"):
        return w.get("state_while_stopped") == "T"
    if kind == "pg_restart":
        return w.get("new_postmaster_pid") != w.get("postmaster_pid")
    if kind == "pg_terminate":
        return bool(w.get("terminated"))
    return bool(w.get("published_again"))


def slot_pids(fleet: Fleet) -> dict[str, list[int]]:
    return {s.name: s.pids for s in fleet.slots.values()}


