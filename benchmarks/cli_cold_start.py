"""Cold wall time of `skyrl plugins list` and `skyrl --version` (target: under 1.5 s).

Each run is a fresh interpreter, so imports are paid every time. Prints the median of each and the
ratio to the 1.5 s budget on the last line.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

BUDGET_S = 1.5
RUNS = 7


def wall(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "skyrl_core", *args], check=True, capture_output=True)
    return time.perf_counter() - start


if __name__ == "__main__":
    commands = {"plugins list": ["plugins", "list"], "plugins list --json": ["plugins", "list", "--json"],
                "--version": ["--version"]}
    medians = {}
    for _ in range(RUNS):  # alternate commands so machine noise hits all of them alike
        for name, args in commands.items():
            medians.setdefault(name, []).append(wall(args))
    for name, times in medians.items():
        print(f"{name:22s} median {statistics.median(times):.3f} s  (min {min(times):.3f}, max {max(times):.3f})")
    worst = max(statistics.median(t) for t in medians.values())
    print(f"slowest median {worst:.3f} s = {worst / BUDGET_S:.2f}x of the {BUDGET_S} s budget")
