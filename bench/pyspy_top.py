"""Summarise a py-spy raw profile (``py-spy record -f raw``): the functions where the scheduler
thread spends its time, inclusive, as a share of its samples.

python bench/pyspy_top.py PROFILE.txt [N] [THREAD_SUBSTRING]
"""

from __future__ import annotations

import sys
from collections import Counter


def main() -> None:
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    thread = sys.argv[3] if len(sys.argv) > 3 else "run_scheduler_loop"
    incl: Counter[str] = Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if thread not in stack:
                continue
            total += int(count)
            for frame in set(stack.split(";")):
                incl[frame] += int(count)
    print(f"{total} samples in threads matching {thread!r}")
    for frame, c in incl.most_common(n):
        print(f"{100 * c / max(total, 1):5.1f}%  {frame[:140]}")


if __name__ == "__main__":
    main()
