"""Run the distributed and kernel tests N times in a row beside a CPU hog, and sum the runs up.

    .venv/bin/python scripts/run_series.py                      # 20 runs, tests/distributed tests/kernel
    .venv/bin/python scripts/run_series.py --runs 5 --hogs 0 --out /tmp/series
    .venv/bin/python scripts/run_series.py --stop-by 05:45      # start no run that would end after it (UTC)

The hog is one busy-looping process per spare core (all cores but one by default). The script
starts it and always ends it: at the end, on an error, on Ctrl-C or SIGTERM (pytest gets a SIGINT
then, to end its kernels); a hog whose parent is gone (this script killed with SIGKILL) ends itself
within a second.

`OUT/results.txt` gets one line per run as soon as it ends (run number, passed, failed, errors,
skipped, seconds, the failing test ids) and the summary at the end; `OUT/run-NN.log` holds that
run's pytest output and `OUT/run-NN.xml` its JUnit report, for finding the cause of a failure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_TESTS = ("tests/distributed", "tests/kernel")

# Spins until its parent is gone; checks about every 0.1-1 s so an orphan does not outlive the series.
HOG_CODE = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(2_000_000):
        pass
"""


@dataclass(slots=True)
class RunResult:
    """What one pytest run of the series gave."""

    number: int
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    exit_code: int = 0
    failing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.failed == 0 and self.errors == 0

    def line(self) -> str:
        failing = " ".join(self.failing) if self.failing else "-"
        return (
            f"run {self.number:2d}  passed {self.passed:3d}  failed {self.failed}  errors {self.errors}  "
            f"skipped {self.skipped}  {self.seconds:7.1f} s  exit {self.exit_code}  failing: {failing}"
        )


def parse_junit(path: Path, result: RunResult) -> None:
    """Fill the counts and failing ids of `result` from a pytest JUnit report."""
    for case in ET.parse(path).getroot().iter("testcase"):
        # classname is the module ("tests.kernel.test_cells"): these folders hold no test classes.
        test_id = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        if case.find("failure") is not None:
            result.failed += 1
            result.failing.append(test_id)
        elif case.find("error") is not None:
            result.errors += 1
            result.failing.append(test_id)
        elif case.find("skipped") is not None:
            result.skipped += 1
        else:
            result.passed += 1


def start_hogs(count: int) -> list[subprocess.Popen]:
    # Own sessions: Ctrl-C in the terminal is for this script, which then ends them itself.
    return [subprocess.Popen([sys.executable, "-c", HOG_CODE], start_new_session=True) for _ in range(count)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    """End every hog; safe to call twice."""
    for hog in hogs:
        if hog.poll() is None:
            hog.kill()
    for hog in hogs:
        hog.wait()
    hogs.clear()


def stop_pytest(pytest: subprocess.Popen) -> None:
    """SIGINT, as Ctrl-C would, so fixtures tear down their kernels and pools; SIGKILL after 60 s."""
    pytest.send_signal(signal.SIGINT)
    try:
        pytest.wait(60)
    except subprocess.TimeoutExpired:
        pytest.kill()
        pytest.wait()


def run_once(number: int, tests: list[str], out: Path, pytest_args: list[str]) -> RunResult:
    log, xml = out / f"run-{number:02d}.log", out / f"run-{number:02d}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *pytest_args, *tests]
    result = RunResult(number)
    start = time.monotonic()
    with log.open("w") as sink:
        # Its own session, so that Ctrl-C reaches pytest once, from here, and it can end its kernels.
        pytest = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            result.exit_code = pytest.wait()
        except KeyboardInterrupt:
            stop_pytest(pytest)
            raise
    result.seconds = time.monotonic() - start
    if xml.exists():
        parse_junit(xml, result)
    elif result.exit_code != 0:
        result.failing.append(f"(no report; see {log})")
    return result


def summary(results: list[RunResult], planned: int, hogs: int) -> list[str]:
    if not results:
        return ["summary: no run finished"]
    seconds = [r.seconds for r in results]
    failing = Counter(test_id for r in results for test_id in r.failing)
    lines = [
        f"summary: {len(results)} of {planned} runs done, {sum(r.ok for r in results)} all green, "
        f"{sum(not r.ok for r in results)} with failures; hogs {hogs}",
        f"tests per run: passed {sorted({r.passed for r in results})} "
        f"skipped {sorted({r.skipped for r in results})}; "
        f"failures {sum(r.failed for r in results)}, errors {sum(r.errors for r in results)} in all",
        f"seconds per run: min {min(seconds):.1f}  median {statistics.median(seconds):.1f}  "
        f"max {max(seconds):.1f}  total {sum(seconds):.1f}",
    ]
    lines += [f"  failed {n}x: {test_id}" for test_id, n in failing.most_common()]
    return lines


def deadline_from(text: str | None) -> float | None:
    """`HH:MM` (UTC, today) as a time.time() value; None when not given."""
    if text is None:
        return None
    hour, minute = (int(part) for part in text.split(":"))
    now = dt.datetime.now(dt.timezone.utc)
    return now.replace(hour=hour, minute=minute, second=0, microsecond=0).timestamp()


def raise_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="runs in a row (default 20)")
    parser.add_argument("--hogs", type=int, default=max(1, (os.cpu_count() or 1) - 1),
                        help="busy-looping processes beside the tests (default: one per spare core)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/fsdp2nb-series"),
                        help="folder for results.txt and each run's log and JUnit report")
    parser.add_argument("--stop-by", metavar="HH:MM",
                        help="UTC time: start no run that the longest run so far would take past it")
    parser.add_argument("tests", nargs="*", default=list(DEFAULT_TESTS))
    args, pytest_args = parser.parse_known_args(argv)
    if args.runs < 1 or args.hogs < 0:
        parser.error(f"--runs must be >= 1 and --hogs >= 0, got {args.runs} and {args.hogs}")
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "results.txt"
    results_file.write_text("")
    deadline = deadline_from(args.stop_by)

    def record(line: str) -> None:
        print(line, flush=True)
        with results_file.open("a") as sink:
            sink.write(line + "\n")

    signal.signal(signal.SIGTERM, raise_on_sigterm)
    results: list[RunResult] = []
    hogs = start_hogs(args.hogs)
    record(f"series started {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC: {args.runs} runs of "
           f"{' '.join(args.tests + pytest_args)}, {args.hogs} hogs on {os.cpu_count()} cores")
    try:
        for number in range(1, args.runs + 1):
            longest = max((r.seconds for r in results), default=0.0)
            if deadline is not None and time.time() + longest > deadline:
                record(f"stopped before run {number}: the longest run ({longest:.0f} s) would end after "
                       f"{args.stop_by} UTC")
                break
            result = run_once(number, args.tests, args.out, pytest_args)
            results.append(result)
            record(result.line())
    except KeyboardInterrupt:
        record(f"interrupted during run {len(results) + 1}")
    finally:
        stop_hogs(hogs)
    for line in summary(results, args.runs, args.hogs):
        record(line)
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
