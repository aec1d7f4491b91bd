"""Steps per second of the control-plane stateful machine (ControlPlaneStateMachine).

Runs the machine under a fixed, derandomized Hypothesis profile (kvfsm.bench.verify.count_steps: a
fixed seed, no database, no shrinking) for a fixed number of examples and steps, three times, and prints
the median steps per second. Usage: ``python scripts/control_steps_per_s.py [examples] [steps]``.
"""

from __future__ import annotations

import statistics
import sys

from kvfsm.bench.verify import count_steps
from kvfsm.testing.control import ControlPlaneStateMachine


def main() -> None:
    examples = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    rates = []
    for _ in range(3):
        n, machines, seconds = count_steps(ControlPlaneStateMachine, examples, steps)
        rates.append(n / seconds)
        print(f"{n} steps in {machines} examples, {seconds:.2f} s: {n / seconds:.0f} steps/s", flush=True)
    print(f"median: {statistics.median(rates):.0f} steps/s")


if __name__ == "__main__":
    main()
