"""Python mutation testing: do the fast tests notice when the deciding code changes?

``make mutate-py`` (or ``python -m tools.mutate_py``) runs mutmut over the modules
``[tool.mutmut]`` in pyproject.toml names (leases, probation, rebalancing, the reaper, the
writer and its lanes, the wire format; the consumer's outcomes, strikes and runner, the
clock-skew check), each mutant against the in-process tests that reach the mutated function
(the selection there: ``tests/test_lease.py`` reaches the outcomes' lease check,
``tests/test_clock_skew.py`` the skew bound, ``tests/test_loop_block.py`` the strikes), then
prints one row per module. The rows and every survivor's diff go
to ``--report`` (markdown). ``--report-only`` tables the last run's results without running;
``--survivors`` runs again only what survived (after adding tests).

mutmut keeps its results in ``mutants/``: a run without names tests only what is new or
changed since; a run with names (globs) tests every mutant they match.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

MUTANTS = Path("mutants")
# mutmut's exit codes (mutmut.stats.status_by_exit_code), folded into what the table shows.
STATUS = {1: "killed", 3: "killed", 0: "survived", 36: "timeout", 24: "timeout", -24: "timeout",
          152: "timeout", 255: "timeout", 5: "no tests", 33: "no tests", 34: "skipped",
          37: "killed"}
COLUMNS = ("killed", "timeout", "survived", "no tests", "other")


def mutmut() -> str:
    """The mutmut script of this interpreter's environment (``python -m mutmut`` would import
    its __main__ twice)."""
    return str(Path(sys.executable).parent / "mutmut")


def results() -> dict[str, dict[str, int | None]]:
    """Exit code by mutant name, per module (dotted), from mutmut's ``.meta`` files."""
    by_module: dict[str, dict[str, int | None]] = {}
    for meta in sorted(MUTANTS.glob("triggerflow/**/*.py.meta")):
        module = ".".join(meta.relative_to(MUTANTS).with_suffix("").with_suffix("").parts)
        by_module[module] = json.loads(meta.read_text())["exit_code_by_key"]
    return by_module


def status(code: int | None) -> str:
    return "not run" if code is None else STATUS.get(code, "other")


def table(by_module: dict[str, dict[str, int | None]]) -> list[str]:
    head = ["module", "mutants", *COLUMNS, "killed %"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    total: Counter[str] = Counter()
    rows = [(m, Counter(status(c) for c in codes.values())) for m, codes in by_module.items()]
    for module, counts in [*rows, ("**all**", sum((c for _, c in rows), total))]:
        run = sum(counts.values()) - counts["not run"]
        dead = counts["killed"] + counts["timeout"]
        score = f"{100 * dead / run:.1f}" if run else "-"
        lines.append(f"| {module} | {run} | " + " | ".join(str(counts[c]) for c in COLUMNS)
                     + f" | {score} |")
    return lines


def survivors(by_module: dict[str, dict[str, int | None]]) -> list[str]:
    return [n for codes in by_module.values() for n, c in sorted(codes.items())
            if status(c) in ("survived", "no tests")]


def diffs(names: list[str]) -> list[str]:
    from mutmut.mutation.diff_apply import get_diff_for_mutant  # reads mutants/ of the cwd

    out: list[str] = []
    for name in names:
        out += ["", f"`{name}`", "```diff", get_diff_for_mutant(name).strip(), "```"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutant name globs, e.g. 'triggerflow.lease*'")
    parser.add_argument("--max-children", type=int, default=2)
    parser.add_argument("--report", default=".tools/mutation-py-report.md")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--survivors", action="store_true",
                        help="run again the mutants that survived (new tests?), and those of NAMES")
    args = parser.parse_args()
    names = [*survivors(results()), *args.names] if args.survivors else args.names
    if args.survivors and not names:
        print("no survivors to run again")
    elif not args.report_only:
        run = subprocess.run([mutmut(), "run", "--max-children", str(args.max_children),
                              *names])
        if run.returncode:
            return run.returncode
    by_module = results()
    rows = table(by_module)
    print("\n".join(rows))
    report = Path(args.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join([*rows, "", "## Survivors", *diffs(survivors(by_module))]) + "\n")
    print(f"survivors' diffs: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
