"""`triggerflow bench chaos --topology cluster`: with a PostgreSQL standby promoted and a
RabbitMQ node stopped while work is in flight, a short seeded run loses, doubles and
misapplies nothing, and both faults really happened.

The run starts servers of its own (a primary with a synchronous standby, a 3-node RabbitMQ
cluster and a forwarder in front of it: ``bench/chaos_cluster.py``); the suite's services
only fill the settings it replaces. Seed 219 draws, within 30 s, the promotion at 8 s and the
stop of the node every connection goes to first (r0) at 12 s, beside a PostgreSQL restart
that waits for the promotion to finish (``bench/chaos_plan.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.chaos_plan import CLUSTER_KINDS, make_plan
from tests.test_bench_chaos import LAST, run_chaos

SEED = 219
SECONDS = 30


def test_the_cluster_kinds_leave_every_other_fault_where_it_was() -> None:
    cluster = make_plan(SEED, SECONDS, "cluster")
    assert [f for f in cluster.faults if f.kind not in CLUSTER_KINDS] == \
        list(make_plan(SEED, SECONDS).faults)
    assert {f.kind for f in cluster.faults} >= set(CLUSTER_KINDS)
    assert cluster.ops == make_plan(SEED, SECONDS).ops


@pytest.mark.slow
@pytest.mark.timeout(900)  # three RabbitMQ nodes boot one after another (minutes under load)
def test_a_promotion_and_a_node_stop_lose_double_and_misapply_nothing(
        tmp_path: Path, pg_server: str, amqp_server: str) -> None:
    out = run_chaos(tmp_path, pg_server, amqp_server, [
        "--topology", "cluster", "--seed", str(SEED), "--minutes", str(SECONDS / 60)],
        timeout=840)
    [path] = (tmp_path / "bench-results").glob(f"chaos-{SEED}-*.json")
    history = json.loads(path.read_text())
    last = LAST.match(out.strip().splitlines()[-1])
    assert last, out[-3000:]
    seed, _, deferred, applied, lost, twice, stale, _ = map(int, last.groups())
    assert (seed, lost, twice, stale) == (SEED, 0, 0, 0)
    assert deferred > 50 and applied > deferred / 2
    assert history["schedule"] == make_plan(SEED, SECONDS, "cluster").digest()
    assert history["drained"]
    real = {f["kind"]: f["witness"] for f in history["faults"] if f["happened"]}
    assert set(CLUSTER_KINDS) <= set(real), history["faults"]
    # the standby left recovery on the next timeline; the old primary came back as a standby
    promoted = real["pg_promote"]
    assert promoted["in_recovery_before"] and not promoted["in_recovery_after"], promoted
    assert promoted["timeline_after"] == promoted["timeline_before"] + 1
    assert promoted["rejoined_as_standby"] and promoted["promoted_port"] != \
        promoted["old_primary_port"]
    # the node left the cluster's running nodes while stopped, and came back
    node = real["rabbit_node_stop"]
    assert node["node"] not in node["running_while_stopped"], node
    assert len(node["running_while_stopped"]) == 2 and len(node["running_after"]) == 3
