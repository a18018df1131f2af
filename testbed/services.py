"""A PostgreSQL cluster and RabbitMQ node(s) of the test session's own, started from the
installed binaries on free ports, so the suite (and its fault tests, which stop and restart
them) never touches the machine's services.

Everything lives under ``BASE/<pid>-<tag>/``; a run that was killed leaves such a directory
behind, and the next run stops whatever still runs there and removes it (``reap_leftovers``).

Both daemons refuse to run as root (as sessions and CI do), so they run as the ``postgres``
and ``rabbitmq`` users on directories those users own; when not root they run as the caller.

``python -m testbed.services -- CMD ...`` runs CMD with ``TRIGGERFLOW_DATABASE_URL``/
``TRIGGERFLOW_AMQP_URL``/``TRIGGERFLOW_MANAGEMENT_URL`` pointing at a fresh pair (durable
settings), then stops them: ``make bench`` uses it to get ``pg_stat_statements`` preloaded
without editing the machine's PostgreSQL.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BASE = Path(os.environ.get("TRIGGERFLOW_TEST_SERVICES_DIR", "/tmp/triggerflow-test-services"))
PG_BIN_ROOT = Path("/usr/lib/postgresql")
RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
# The machine's user whose ~/.erlang.cookie every node (and rabbitmqctl) shares: a later
# cluster test joins nodes with it.
RABBIT_HOME = Path("/var/lib/rabbitmq")
# Generous: under `make test` several nodes boot at once, on a machine that may be busy too.
START_TIMEOUT = 240.0


def free_port(low: int | None = None, high: int | None = None) -> int:
    """A port nothing listens on now: any (the kernel's pick), or one in [low, high)."""
    for _ in range(200):
        port = random.randrange(low, high) if low and high else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            found: int = s.getsockname()[1]
            return found
    raise RuntimeError(f"no free port in [{low}, {high})")


def dist_port() -> int:
    """Erlang distribution port. RabbitMQ's CLI tools connect from dist port + 10000, so it
    must stay below 55535; the kernel's ephemeral picks often do not."""
    return free_port(20000, 30000)


def _as_user(user: str) -> list[str]:
    """Prefix a command so it runs as ``user`` when we are root (daemons refuse root)."""
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", user, "--"]


def _chown_tree(path: Path, user: str) -> None:
    if os.geteuid() != 0:
        return
    entry = pwd.getpwnam(user)
    for root, dirs, files in os.walk(path):
        for name in (root, *(os.path.join(root, n) for n in dirs + files)):
            os.chown(name, entry.pw_uid, entry.pw_gid)


def _run(cmd: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 120,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=timeout,
                          cwd="/")
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


def pg_bin() -> Path:
    versions = sorted((p for p in PG_BIN_ROOT.glob("*/bin") if (p / "initdb").exists()),
                      key=lambda p: int(p.parent.name))
    if not versions:
        raise RuntimeError(f"no PostgreSQL server binaries under {PG_BIN_ROOT}")
    return versions[-1]


# Test-only speed-ups: the data survives a clean restart (the fault tests' kind) but not an
# OS crash, which no test causes.
FAST_PG = {"fsync": "off", "full_page_writes": "off"}


@dataclass
class PostgresCluster:
    """One PostgreSQL cluster: ``initdb`` into ``root/data``, socket and log in ``root``.

    ``settings`` are written to its postgresql.conf, so they survive ``restart()``;
    ``pg_stat_statements`` is always preloaded (the benchmark counts statements)."""

    root: Path
    port: int = field(default_factory=free_port)
    settings: dict[str, str] = field(default_factory=dict)
    user: str = "postgres"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        """Server URL without a database (tests append ``/<name>``)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}"

    def _ctl(self, *args: str, timeout: float = START_TIMEOUT) -> None:
        log = self.root / "postgres.log"
        try:
            _run([*_as_user(self.user), str(pg_bin() / "pg_ctl"), "-D", str(self.data),
                  "-l", str(log), "-w", "-t", str(int(timeout)), *args], timeout=timeout + 10)
        except RuntimeError as exc:  # pg_ctl only says "examine the log output"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
            raise RuntimeError(f"{exc}\n--- {log}:\n{tail}") from exc

    def start(self) -> PostgresCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        _chown_tree(self.root, self.user)
        _run([*_as_user(self.user), str(pg_bin() / "initdb"), "-D", str(self.data),
              "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"])
        conf = {
            "port": str(self.port),
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.root}'",
            "shared_preload_libraries": "'pg_stat_statements'",
            "max_connections": "300",
            **self.settings,
        }
        with open(self.data / "postgresql.conf", "a") as f:
            f.write("\n# testbed/services.py\n")
            f.writelines(f"{k} = {v}\n" for k, v in conf.items())
        self._ctl("start")
        return self

    def restart(self) -> None:
        self._ctl("restart", "-m", "fast")

    def pause(self) -> None:
        """Stop the server (fast shutdown) and keep its data: ``resume`` starts it again."""
        self._ctl("stop", "-m", "fast")

    def resume(self) -> None:
        self._ctl("start")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._ctl("stop", "-m", "immediate", timeout=60)

    def start_standby(self, root: Path, port: int | None = None) -> PostgresCluster:
        """A streaming standby of this (running) cluster under ``root``, on a port of its own
        (or ``port``: a server that comes back as a standby where clients look for it).

        ``pg_basebackup -R`` copies the data directory with this cluster's settings and writes
        ``standby.signal`` and ``primary_conninfo``; the standby's own port, socket directory
        and an empty ``synchronous_standby_names`` are appended (once promoted it has no
        standby of its own to wait for: with the primary's ``'*'`` every commit would hang)."""
        standby = PostgresCluster(root, port or free_port(), user=self.user)
        root.mkdir(parents=True, exist_ok=True)
        _chown_tree(root, self.user)
        _run([*_as_user(self.user), str(pg_bin() / "pg_basebackup"), "-D", str(standby.data),
              "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-R", "-X", "stream",
              "--no-sync", "--checkpoint=fast"])  # not a spread checkpoint: minutes under load
        with open(standby.data / "postgresql.conf", "a") as f:
            f.write(f"\n# testbed/services.py: standby\nport = {standby.port}\n"
                    f"unix_socket_directories = '{root}'\nsynchronous_standby_names = ''\n")
        standby._ctl("start")
        return standby

    def promote(self) -> None:
        """End recovery: this standby becomes a primary (``pg_ctl promote`` waits for it)."""
        self._ctl("promote")

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend at once, as a host or container dying:
        no shutdown checkpoint, every client's socket reset."""
        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for victim in (pid, *map(int, children)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _pid_alive(pid) and not _zombie(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # a later stop() must not signal whatever process reuses the pid
        (self.data / "postmaster.pid").unlink(missing_ok=True)


@dataclass
class RabbitNode:
    """One RabbitMQ node with its own config file (AMQP and management ports), node name,
    distribution port, mnesia/log dirs and enabled-plugins file (management on).

    Several nodes made with the same ``root`` parent and started side by side can be
    clustered with ``ctl("stop_app")``, ``ctl("join_cluster", other.nodename)``,
    ``start_app()``: they share the machine user's Erlang cookie. (Tried by hand with
    ``start_services(rabbit_nodes=3)``: three nodes started in 68 s on a 2-core machine,
    joined, and ``cluster_status`` listed all three running.)"""

    root: Path
    name: str = field(default_factory=lambda: f"tftest{os.getpid()}{uuid.uuid4().hex[:4]}")
    amqp_port: int = field(default_factory=free_port)
    management_port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=dist_port)
    user: str = "rabbitmq"
    process: subprocess.Popen[bytes] | None = None
    start_timeout: float = START_TIMEOUT

    @property
    def nodename(self) -> str:
        return f"{self.name}@localhost"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/"

    @property
    def management_url(self) -> str:
        return f"http://guest:guest@127.0.0.1:{self.management_port}/"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")}
        env.update({
            "HOME": str(RABBIT_HOME) if os.geteuid() == 0 else env.get("HOME", "/"),
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_CONFIG_FILE": str(self.root / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "enabled_plugins"),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.root / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.root / "log"),
            "RABBITMQ_PID_FILE": str(self.root / "rabbit.pid"),
            # The machine's rabbitmq-env.conf names its own node; ours must not read it.
            "RABBITMQ_CONF_ENV_FILE": str(self.root / "rabbitmq-env.conf"),
        })
        return env

    def ctl(self, *args: str, timeout: float = START_TIMEOUT) -> str:
        return _run([*_as_user(self.user), str(RABBIT_BIN / "rabbitmqctl"), "-n", self.nodename,
                     *args], env=self.env(), timeout=timeout).stdout

    def start(self) -> RabbitNode:
        for sub in ("mnesia", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.amqp_port}\n"
            f"management.tcp.ip = 127.0.0.1\n"
            f"management.tcp.port = {self.management_port}\n"
            "# management API numbers refresh each second, not every 5 (status tests read them)\n"
            "collect_statistics_interval = 1000\n"
            "# the suite fills its own disk less than the machine's default alarm fears\n"
            "disk_free_limit.absolute = 50MB\n"
            "# as the shipped brokers/rabbitmq/rabbitmq.conf (triggerflow.wire.MAX_MESSAGE_BYTES)\n"
            "max_message_size = 4194304\n")
        # the event exchange announces deleted presence queues (transport.presence), as shipped
        (self.root / "enabled_plugins").write_text("[rabbitmq_management,rabbitmq_event_exchange].\n")
        (self.root / "rabbitmq-env.conf").write_text("ERL_EPMD_ADDRESS=127.0.0.1\n")
        (self.root / "nodename").write_text(self.nodename)
        _chown_tree(self.root, self.user)
        log = open(self.root / "server.out", "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            [*_as_user(self.user), str(RABBIT_BIN / "rabbitmq-server")], env=self.env(),
            stdout=log, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True)
        log.close()
        try:
            self.await_startup()
        except Exception:
            self.stop()
            raise
        return self

    def await_startup(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                out = (self.root / "server.out").read_text(errors="replace")
                raise RuntimeError(f"rabbitmq-server {self.nodename} exited:\n{out[-3000:]}")
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.ctl("await_startup", "--timeout", "5", timeout=30)
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.nodename} did not start within {self.start_timeout}s")
            time.sleep(0.5)

    def stop_app(self) -> None:
        self.ctl("stop_app")

    def start_app(self) -> None:
        self.ctl("start_app")
        self.await_startup()

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.ctl("stop", timeout=60)
        if self.process is not None:
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


@dataclass
class Services:
    """The session's PostgreSQL cluster and RabbitMQ node (``nodes`` leaves room for more)."""

    root: Path
    postgres: PostgresCluster
    nodes: list[RabbitNode]

    @property
    def rabbit(self) -> RabbitNode:
        return self.nodes[0]

    def stop(self) -> None:
        try:
            for node in self.nodes:
                node.stop()
            self.postgres.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _zombie(pid: int) -> bool:
    """Dead but not yet reaped by its parent (state ``Z`` in /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def reap_leftovers(base: Path = BASE) -> list[Path]:
    """Stop the services of runs whose pytest process is gone, and remove their dirs."""
    removed = []
    for run in sorted(base.glob("*-*")) if base.exists() else []:
        owner = run.name.split("-", 1)[0]
        if not owner.isdigit() or _pid_alive(int(owner)):
            continue
        for nodefile in run.glob("rabbit*/nodename"):
            node = RabbitNode(nodefile.parent, name=nodefile.read_text().split("@")[0])
            with contextlib.suppress(Exception):
                node.ctl("stop", timeout=60)
        # the session's cluster, or a primary and its standby (testbed/replication.py)
        for pidfile in run.glob("*/data/postmaster.pid"):
            with contextlib.suppress(Exception):
                PostgresCluster(pidfile.parent.parent).stop()
        shutil.rmtree(run, ignore_errors=True)
        removed.append(run)
    return removed


def start_services(*, fast: bool = True, rabbit_nodes: int = 1) -> Services:
    """Start a cluster and ``rabbit_nodes`` unclustered nodes under a fresh directory."""
    reap_leftovers()
    BASE.mkdir(parents=True, exist_ok=True)
    BASE.chmod(0o1777)  # shared by every user's runs, like /tmp
    root = BASE / f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
    root.mkdir(mode=0o755)
    postgres = PostgresCluster(root / "postgres", settings=dict(FAST_PG) if fast else {})
    services = Services(root, postgres, [])
    try:
        postgres.start()
        for i in range(rabbit_nodes):
            services.nodes.append(RabbitNode(root / f"rabbit{i}").start())
    except BaseException:
        services.stop()
        raise
    return services


@contextlib.contextmanager
def running_services(**kwargs: bool | int) -> Iterator[Services]:
    services = start_services(**kwargs)  # type: ignore[arg-type]
    try:
        yield services
    finally:
        services.stop()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m testbed.services -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    with running_services(fast=False) as s:
        env = dict(os.environ)
        env["TRIGGERFLOW_DATABASE_URL"] = f"{s.postgres.url}/triggerflow"
        env["TRIGGERFLOW_AMQP_URL"] = s.rabbit.url
        env["TRIGGERFLOW_MANAGEMENT_URL"] = s.rabbit.management_url
        print(f"testbed.services: PostgreSQL {s.postgres.url} (pg_stat_statements preloaded), "
              f"RabbitMQ {s.rabbit.url}", file=sys.stderr)
        return subprocess.run(argv, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
