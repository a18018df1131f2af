"""compose.yaml and brokers/rabbitmq/ agree with the Compose schema, the CLI and the code.

No Docker engine runs here, so these checks are what stops a deployment file from
naming a subcommand, flag, setting, user or queue argument that does not exist.
RabbitMQ refuses to re-declare a queue with other arguments, so the definitions file
must match what ``triggerflow.transport.rabbitmq.Topology`` declares.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import click
import jsonschema
import pytest
import yaml

from triggerflow.transport.topology import EVENT_EXCHANGE, QUEUE_DELETED, Topology

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_SCHEMA = Path(__file__).resolve().parents[2] / "shared" / "schemas" / "compose-spec.json"
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
DEFINITIONS: dict[str, Any] = json.loads(
    (ROOT / "brokers" / "rabbitmq" / "definitions.json").read_text()
)
NAMESPACE = "triggerflow"
DELIVERY_LIMIT = 5


def _built_here(service: dict[str, Any]) -> bool:
    build = service.get("build")
    context = build.get("context") if isinstance(build, dict) else build
    return context in (".", "./")


APP = {name: svc for name, svc in COMPOSE["services"].items() if _built_here(svc)}
HEALTHCHECKED = {name: svc for name, svc in APP.items() if "healthcheck" in svc}


def _option_values(command: list[str], flag: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == flag]


# The team queues are the ones the topology job declares.
(TOPOLOGY_JOB,) = [svc for svc in APP.values() if svc["command"][:2] == ["topology", "apply"]]
TEAM_QUEUES = _option_values(TOPOLOGY_JOB["command"], "--queue")
CONSUMERS = {name: svc for name, svc in APP.items() if svc["command"][0] == "consume"}


def _resolve(argv: list[str]) -> click.Command:
    """Walk ``triggerflow.cli.main`` as click would and check every flag in ``argv``."""
    from triggerflow.cli import main

    command: click.Command = main
    path = ["triggerflow"]
    rest = list(argv)
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        name = rest.pop(0)
        sub = command.get_command(click.Context(command), name)  # the root group loads lazily
        assert sub is not None, f"{' '.join(path)} has no subcommand {name!r}"
        command = sub
        path.append(name)
    assert not isinstance(command, click.Group) or command.invoke_without_command, (
        f"{' '.join(path)} needs a subcommand"
    )
    flags = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    for arg in rest:
        if arg.startswith("-"):
            flag = arg.split("=", 1)[0]
            assert flag in flags, f"{' '.join(path)} has no option {flag} (has {sorted(flags)})"
    return command


def _amqp_credentials(service: dict[str, Any]) -> tuple[str, str, str]:
    url = urlsplit(service["environment"]["TRIGGERFLOW_AMQP_URL"])
    assert url.username and url.password is not None
    vhost = unquote(url.path[1:]) or "/"
    return unquote(url.username), unquote(url.password), vhost


def _user_permissions(user: str, vhost: str) -> dict[str, str]:
    (perms,) = [p for p in DEFINITIONS["permissions"] if p["user"] == user and p["vhost"] == vhost]
    return perms


def test_compose_matches_the_compose_specification() -> None:
    if not COMPOSE_SCHEMA.is_file():
        pytest.skip(f"Compose schema not found at {COMPOSE_SCHEMA}")
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(COMPOSE)
    ]
    assert errors == []


@pytest.mark.parametrize("service", sorted(APP))
def test_command_is_a_cli_command(service: str) -> None:
    _resolve(APP[service]["command"])


@pytest.mark.parametrize("service", sorted(HEALTHCHECKED))
def test_healthcheck_asks_the_process_readyz_on_its_metrics_port(service: str) -> None:
    """The check is the process's own /readyz (as the Helm chart's readiness probe), fetched
    by the image's Python; urlopen raises, so exits non-zero, on a 503 or no answer."""
    svc = HEALTHCHECKED[service]
    kind, program, flag, code = svc["healthcheck"]["test"]
    assert (kind, program, flag) == ("CMD", "python", "-c")
    port = svc["environment"]["TRIGGERFLOW_METRICS_PORT"]
    (url,) = re.findall(r"urlopen\('([^']+)'", code)
    assert url == f"http://127.0.0.1:{port}/readyz"
    compile(code, "healthcheck", "exec")


@pytest.mark.parametrize("service", sorted(APP))
def test_environment_names_settings(service: str) -> None:
    from triggerflow.settings import Settings

    prefix = "TRIGGERFLOW_"
    names = {key.removeprefix(prefix).lower() for key in APP[service].get("environment", {})}
    assert names - set(Settings.model_fields) == set()


@pytest.mark.parametrize("service", sorted(APP))
def test_amqp_user_exists_with_that_password(service: str) -> None:
    user, password, vhost = _amqp_credentials(APP[service])
    (entry,) = [u for u in DEFINITIONS["users"] if u["name"] == user]
    assert entry["hashing_algorithm"] == "rabbit_password_hashing_sha256"
    salted = base64.b64decode(entry["password_hash"])
    salt, digest = salted[:4], salted[4:]
    assert hashlib.sha256(salt + password.encode()).digest() == digest
    assert _user_permissions(user, vhost)


@pytest.mark.parametrize("service", sorted(CONSUMERS))
def test_consumer_user_may_read_and_publish_for_its_queues(service: str) -> None:
    user, _, vhost = _amqp_credentials(CONSUMERS[service])
    read = _user_permissions(user, vhost)["read"]
    topic_write = {
        p["exchange"]: p["write"]
        for p in DEFINITIONS["topic_permissions"]
        if p["user"] == user and p["vhost"] == vhost
    }
    queues = _option_values(CONSUMERS[service]["command"], "--queue")
    assert queues
    for queue in queues:
        assert queue in TEAM_QUEUES
        assert re.match(read, queue), f"{user} may not consume {queue}"
        write = _user_permissions(user, vhost)["write"]
        topology = Topology(namespace=NAMESPACE)
        for exchange in (topology.deferrals_of(queue), topology.control_of(queue)):
            assert re.match(write, exchange), f"{user} may not publish to {exchange}"
        for exchange in (topology.events, topology.dead):
            assert re.match(write, exchange), f"{user} may not publish to {exchange}"
            assert re.match(topic_write[exchange], queue), f"{user} may not publish {queue} to {exchange}"
        assert re.match(read, topology.control_of(queue)), f"{user} may not bind its control queue"


def test_team_users_reach_no_other_teams_exchanges() -> None:
    """A team user writes and binds only its own queue's exchanges: CC/BCC headers route only
    among the queues bound to the exchange published to (docs/security.md, attack 7)."""
    topology = Topology(namespace=NAMESPACE)
    users = {p["user"]: p for p in DEFINITIONS["permissions"] if p["user"] != "triggerflow-admin"}
    assert users
    for user, perms in users.items():
        for other in TEAM_QUEUES:
            if re.match(perms["read"], other):
                continue  # its own queue
            for exchange in (topology.deferrals_of(other), topology.control_of(other)):
                assert not re.match(perms["write"], exchange), (user, exchange)
                assert not re.match(perms["read"], exchange), (user, exchange)
        for shared in (topology.deferrals, topology.control, topology.events, topology.dead):
            assert not re.match(perms["read"], shared), (user, shared)


def test_writer_knows_each_consumers_user() -> None:
    writers = [svc for svc in APP.values() if svc["command"] == ["writer"]]
    assert writers
    expected = {
        queue: _amqp_credentials(svc)[0]
        for svc in CONSUMERS.values()
        for queue in _option_values(svc["command"], "--queue")
    }
    for writer in writers:
        assert json.loads(writer["environment"]["TRIGGERFLOW_TEAM_USERS"]) == expected


def test_team_queues_are_bound_by_their_name() -> None:
    bindings = {(b["source"], b["destination"], b["routing_key"]) for b in DEFINITIONS["bindings"]}
    topology = Topology(namespace=NAMESPACE)
    for queue in TEAM_QUEUES:
        assert (topology.deferrals_of(queue), queue, queue) in bindings
        assert [b for b in bindings if b[0] == topology.deferrals_of(queue)] == [
            (topology.deferrals_of(queue), queue, queue)]
    queues = {q["name"] for q in DEFINITIONS["queues"]}
    exchanges = {e["name"] for e in DEFINITIONS["exchanges"]}
    relays = [b for b in DEFINITIONS["bindings"] if b["destination_type"] == "exchange"]
    for b in DEFINITIONS["bindings"]:
        if b not in relays:
            assert b["source"] in exchanges and b["destination"] in queues
    # the one exchange-to-exchange binding: the event plugin's deleted queues to presence
    assert [(b["source"], b["destination"], b["routing_key"]) for b in relays] == [
        (EVENT_EXCHANGE, topology.presence, QUEUE_DELETED)]


def test_queue_arguments_match_topology() -> None:
    expected = Topology(namespace=NAMESPACE).queue_arguments(delivery_limit=DELIVERY_LIMIT)
    arguments = {q["name"]: q["arguments"] for q in DEFINITIONS["queues"]}
    for queue in [*TEAM_QUEUES, f"{NAMESPACE}.events"]:
        assert arguments[queue] == expected, queue


def test_exchanges_match_topology() -> None:
    declared = {e["name"]: e["type"] for e in DEFINITIONS["exchanges"]}
    topology = Topology(namespace=NAMESPACE)
    expected = dict(topology.exchanges())
    for queue in TEAM_QUEUES:
        expected.update(topology.team_exchanges(queue))
    assert declared == expected


def test_policies_match_topology() -> None:
    """The length limits ``topology apply`` sets are the ones the definitions load."""
    topology = Topology(namespace=NAMESPACE)
    loaded = {p["name"]: {k: p[k] for k in ("pattern", "apply-to", "priority", "definition")}
              for p in DEFINITIONS["policies"]}
    expected = dict([topology.dead_policy(), *map(topology.limits_policy, TEAM_QUEUES)])
    assert loaded == expected


def test_cluster_profile_adds_two_members_that_join_the_first_node() -> None:
    services = COMPOSE["services"]
    members = [n for n, svc in services.items() if "cluster" in svc.get("profiles", [])
               and n.startswith("rabbitmq-") and n != "rabbitmq-grow"]
    assert sorted(members) == ["rabbitmq-2", "rabbitmq-3"]
    conf = (ROOT / "brokers" / "rabbitmq" / "cluster-member.conf").read_text()
    listed = re.findall(r"^cluster_formation\.classic_config\.nodes\.\d+ = rabbit@(\S+)$", conf,
                        re.MULTILINE)
    assert sorted(listed) == ["rabbitmq", *members]
    cookies = {services[n]["environment"]["RABBITMQ_ERLANG_COOKIE"]
               for n in ("rabbitmq", *members, "rabbitmq-grow")}
    assert len(cookies) == 1  # one cluster, one Erlang cookie
    for name in members:
        assert services[name]["hostname"] == name
        mounts = {v.split(":")[1] for v in services[name]["volumes"]}
        assert "/etc/rabbitmq/rabbitmq.conf" in mounts
    grow = " ".join(services["rabbitmq-grow"]["command"])
    assert all(f"grow rabbit@{m} all" in grow for m in members)
