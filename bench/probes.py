"""What one health probe costs: the process's own ``/readyz`` against the CLI probe.

``python -m testbed.services -- python -m bench.probes [N]`` (or any environment
with ``TRIGGERFLOW_DATABASE_URL`` and ``TRIGGERFLOW_AMQP_URL``): starts one real consumer with
a metrics port, then probes it ``N`` times over HTTP (a new connection each time, as the
kubelet does) and measures the consumer's CPU from ``/proc/<pid>/stat`` before and after,
less what it spends idle over the same time; then runs the exec probes (``curl``,
``triggerflow health`` against the endpoint, ``triggerflow health`` against the database)
and reads each child's CPU time and peak memory from ``wait4``. Prints a Markdown table.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def get(port: int, path: str) -> tuple[int, int, int]:
    """(status, bytes sent, bytes received) of one GET on a fresh connection."""
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request.encode())
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return int(received.split(b" ", 2)[1]), len(request), len(received)


def run_measured(argv: Sequence[str], env: dict[str, str]) -> tuple[int, float, int]:
    """(exit code, CPU seconds, peak RSS in KiB) of one child process."""
    child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return child.returncode, usage.ru_utime + usage.ru_stime, usage.ru_maxrss


def exec_row(name: str, argv: Sequence[str], env: dict[str, str], n: int) -> str:
    runs = [run_measured(argv, env) for _ in range(n)]
    codes = {code for code, _, _ in runs}
    cpu_ms = 1000 * sum(cpu for _, cpu, _ in runs) / n
    rss_mb = max(rss for _, _, rss in runs) / 1024
    return f"| {name} | {cpu_ms:.1f} | {rss_mb:.0f} MB peak RSS (exit {sorted(codes)}) |"


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 1000
    port = _free_port()
    queue = f"probe-{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, TRIGGERFLOW_NAMESPACE=f"tfprobe{uuid.uuid4().hex[:6]}",
               TRIGGERFLOW_LOG_LEVEL="WARNING")
    tf = [sys.executable, "-m", "triggerflow"]
    subprocess.run([*tf, "db", "upgrade"], env=env, check=True, capture_output=True)
    subprocess.run([*tf, "topology", "apply", "--queue", queue], env=env, check=True,
                   capture_output=True)
    consumer = subprocess.Popen([*tf, "consume", "--queue", queue],
                                env=dict(env, TRIGGERFLOW_METRICS_PORT=str(port)))
    try:
        _wait_ready(port)
        rows = [_http_row(consumer.pid, port, n)]
        with_port = dict(env, TRIGGERFLOW_METRICS_PORT=str(port))
        k = max(3, n // 100)
        rows.append(exec_row("exec `curl -fsS …/readyz`",
                             ["curl", "-fsS", f"http://127.0.0.1:{port}/readyz"], env, k))
        rows.append(exec_row("exec `triggerflow health` (endpoint)", [*tf, "health"],
                             with_port, k))
        rows.append(exec_row("exec `triggerflow health --kind consumer` (database)",
                             [*tf, "health", "--kind", "consumer"], env, k))
    finally:
        consumer.terminate()
        consumer.wait(30)
    print("| probe | CPU-ms per probe | bytes / memory per probe |")
    print("|---|---:|---|")
    print("\n".join(rows))
    return 0


def _http_row(pid: int, port: int, n: int) -> str:
    """The consumer's own CPU per /readyz, idle time subtracted; bytes on the wire."""
    idle_start, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(10)
    idle_rate = (cpu_seconds(pid) - idle_start) / (time.monotonic() - t0)
    start, t0 = cpu_seconds(pid), time.monotonic()
    sent = received = 0
    for _ in range(n):
        status, out, back = get(port, "/readyz")
        assert status == 200, status
        sent, received = sent + out, received + back
    elapsed = time.monotonic() - t0
    per_probe = (cpu_seconds(pid) - start - idle_rate * elapsed) / n
    return (f"| HTTP GET /readyz (kubelet httpGet), served by the process | "
            f"{1000 * per_probe:.2f} | {sent // n} B sent + {received // n} B received |")


def _wait_ready(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if get(port, "/readyz")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the consumer's /readyz on {port} did not answer 200 in {timeout}s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
