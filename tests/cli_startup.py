"""Start-up cost of the CLI: best-of-N wall and CPU (user+sys) time of the commands a probe
or an operator runs, for one source tree. Prints the table of docs/cli.md#start-up.

    python -m tests.cli_startup [TREE] [N]

``TREE`` goes first on PYTHONPATH (default: this checkout), so two checkouts compare. The
run commands are refused right after their settings are validated (exit 2), so they
measure the start of the command and nothing of its work.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

COMMANDS: list[tuple[list[str], dict[str, str]]] = [
    (["--help"], {}),
    (["status", "--help"], {}),
    (["health", "--help"], {}),
    (["defer", "--help"], {}),
    (["status"], {"TRIGGERFLOW_HEARTBEAT": "0"}),
    (["health"], {"TRIGGERFLOW_HEARTBEAT": "0"}),
    (["defer", "--queue", "q", "--trigger", "x.Y"], {"TRIGGERFLOW_HEARTBEAT": "0"}),
]


def best_of(tree: str, args: list[str], extra: dict[str, str], n: int) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIGGERFLOW_")}
    env.update(extra, PYTHONPATH=tree)
    walls, cpus = [], []
    for _ in range(n):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "triggerflow", *args], env=env, cwd=tree,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return min(walls), min(cpus)


def main() -> None:
    tree = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    print("| command | wall ms | CPU ms |\n|---|---|---|")
    for args, extra in COMMANDS:
        wall, cpu = best_of(tree, args, extra, n)
        label = " ".join([*(f"{k}={v}" for k, v in extra.items()), "triggerflow", *args])
        print(f"| `{label}` | {wall * 1000:.0f} | {cpu * 1000:.0f} |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
