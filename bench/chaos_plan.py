"""The schedule of ``triggerflow bench chaos``, drawn from the seed alone: the workload's
operations and the nemesis's faults, each at an offset from the start. The same seed and
minutes give the same schedule, so a failing seed is run again as it was."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass

OPS_PER_S = 6.0  # workload operations per second
FAULT_GAP = 5.0  # mean seconds between two faults
LEAD = (1.0, 15.0)  # a deferral is due this many seconds after it is made
RECENT = 40  # cancels and re-deferrals pick among the latest deferrals (most still waiting)
TEAMS = ("a", "b")  # team queues, two consumers each
SLOTS = ("a1", "a2", "b1", "b2", "w1", "w2")  # the processes: consumers of a and b, writers
# Fault kinds and how often each is drawn.
KINDS = {"consumer_kill": 3, "consumer_term": 2, "consumer_stop": 2, "writer_kill": 2,
         "writer_term": 1, "writer_stop": 1, "pg_restart": 1, "pg_terminate": 2, "replay": 2}
# Clock skew and bad input: drawn apart, from a stream of their own, so the kinds above fall
# on the same moments for a seed as before these were added (and as in Airflow mode).
MORE_KINDS = {"consumer_skew": 2, "bad_message": 3, "bad_trigger": 3}
MORE_GAP = 8.0  # mean seconds between two of them
# What a hostile or broken client sends (``bad_message``: each fault a random non-empty
# subset, so a short run sees every one) and the deferrals of bad triggers (``bad_trigger``).
BAD_MESSAGES = ("wakeup_malformed", "wakeup_oversized", "wakeup_unknown", "wakeup_foreign",
                "event_malformed", "event_oversized", "event_unknown", "event_forged",
                "event_fenced")
BAD_TRIGGERS = ("kwargs", "raise", "hang", "block", "garbage")
SKEW = (30.0, 300.0)  # a skewed consumer's clock is this far off (either way), seconds
# ``--topology cluster`` only (a synchronous standby, 3 RabbitMQ nodes): the primary stopped
# and its standby promoted, a broker node stopped and started again. Drawn from a stream of
# their own too, so every kind above falls on the same moments with either topology.
CLUSTER_KINDS = {"pg_promote": 1, "rabbit_node_stop": 1}
CLUSTER_GAP = 20.0  # mean seconds between two of them (each takes seconds to tens of seconds)
NODES = ("r0", "r1", "r2")  # the broker nodes, by index


@dataclass(frozen=True)
class Op:
    at: float  # seconds from the start
    op: str  # "defer" (a new task or, with ``again``, a re-deferral) or "cancel"
    d: str = ""  # the deferral's token (defer), or the one to cancel (cancel)
    task: str = ""
    team: str = ""
    kind: str = ""  # "timer", "coroutine" (a resume) or "end" (a task-end event)
    lead: float = 0.0
    again: bool = False


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str
    slot: str = ""  # the process it hits (kill, term, stop), or the broker node (r0-r2)
    # how long a process or a broker node stays stopped, or down before its restart (or,
    # pg_promote, before the standby is promoted: an HA manager's detection time)
    seconds: float = 0.0
    share: float = 0.0  # pg_terminate: the share of connections; replay: of captured events
    roles: tuple[str, ...] = ()  # pg_terminate: whose connections
    skew: float = 0.0  # consumer_skew: the restarted consumer's clock offset, seconds
    variants: tuple[str, ...] = ()  # bad_message, bad_trigger: which bad inputs
    team: str = ""  # bad_message, bad_trigger: the team whose queue they go to


@dataclass(frozen=True)
class Plan:
    seed: int
    seconds: float
    ops: tuple[Op, ...]
    faults: tuple[Fault, ...]

    def digest(self) -> str:
        """A short fingerprint of the schedule: two runs of a seed print the same."""
        text = json.dumps([[asdict(o) for o in self.ops], [asdict(f) for f in self.faults]])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def make_plan(seed: int, seconds: float, topology: str = "single") -> Plan:
    faults = (*_faults(random.Random(f"{seed}/nemesis"), seconds),
              *_more(random.Random(f"{seed}/nemesis-more"), seconds))
    if topology == "cluster":
        faults += _cluster(random.Random(f"{seed}/nemesis-cluster"), seconds)
    return Plan(seed, seconds, _ops(random.Random(f"{seed}/workload"), seconds),
                tuple(sorted(faults, key=lambda f: f.at)))


def _ops(rng: random.Random, seconds: float) -> tuple[Op, ...]:
    ops: list[Op] = []
    made: list[Op] = []  # deferrals so far
    t = 0.5
    while True:
        t += rng.expovariate(OPS_PER_S)
        if t >= seconds:
            return tuple(ops)
        r = rng.random()
        if made and r < 0.12:
            ops.append(Op(t, "cancel", d=rng.choice(made[-RECENT:]).d))
            continue
        kind = rng.choices(("timer", "coroutine", "end"), (6, 3, 1))[0]
        lead = round(rng.uniform(*LEAD), 3)
        if made and r < 0.27:  # the same task deferred again: a new attempt
            prev = rng.choice(made[-RECENT:])
            op = Op(t, "defer", f"d{len(made)}", prev.task, prev.team, kind, lead, again=True)
        else:
            op = Op(t, "defer", f"d{len(made)}", f"t{len(made)}", rng.choice(TEAMS), kind,
                    lead)
        made.append(op)
        ops.append(op)


def _moments(rng: random.Random, seconds: float, gap: float,
             kinds: dict[str, int]) -> Iterator[tuple[float, str]]:
    """Moments ``gap`` s apart on average from 2 s on, each with a kind drawn by weight;
    the caller draws the fault's details from ``rng`` before the next moment is drawn."""
    t = 2.0
    names, weights = list(kinds), list(kinds.values())
    while True:
        t += rng.expovariate(1 / gap)
        if t >= seconds:
            return
        yield round(t, 3), rng.choices(names, weights)[0]


def _faults(rng: random.Random, seconds: float) -> tuple[Fault, ...]:
    faults: list[Fault] = []
    for t, kind in _moments(rng, seconds, FAULT_GAP, KINDS):
        if kind.startswith("consumer_"):
            slot = rng.choice(SLOTS[:4])
        elif kind.startswith("writer_"):
            slot = rng.choice(SLOTS[4:])
        else:
            slot = ""
        pause = round(rng.uniform(1.0, 8.0) if kind.endswith("_stop")
                      else rng.uniform(0.2, 3.0), 2)  # stopped for, or down before restart
        roles = rng.choice((("consumer",), ("writer",), ("consumer", "writer")))
        faults.append(Fault(t, kind, slot, pause, round(rng.uniform(0.3, 1.0), 2),
                            roles if kind == "pg_terminate" else ()))
    return tuple(faults)


def _more(rng: random.Random, seconds: float) -> tuple[Fault, ...]:
    faults: list[Fault] = []
    for t, kind in _moments(rng, seconds, MORE_GAP, MORE_KINDS):
        if kind == "consumer_skew":  # skewed for a while, then restarted with a good clock
            faults.append(Fault(t, kind, rng.choice(SLOTS[:4]),
                                round(rng.uniform(5.0, 12.0), 2),
                                skew=round(rng.uniform(*SKEW) * rng.choice((1, -1)), 1)))
            continue
        pool = BAD_MESSAGES if kind == "bad_message" else BAD_TRIGGERS
        picked = tuple(v for v in pool if rng.random() < 0.5) or (rng.choice(pool),)
        faults.append(Fault(t, kind, variants=picked, team=rng.choice(TEAMS)))
    return tuple(faults)


def _cluster(rng: random.Random, seconds: float) -> tuple[Fault, ...]:
    faults: list[Fault] = []
    for t, kind in _moments(rng, seconds, CLUSTER_GAP, CLUSTER_KINDS):
        if kind == "pg_promote":  # promoted this long after the primary stopped
            faults.append(Fault(t, kind, seconds=round(rng.uniform(0.5, 3.0), 2)))
        else:
            faults.append(Fault(t, kind, rng.choice(NODES), round(rng.uniform(2.0, 10.0), 2)))
    return tuple(faults)
