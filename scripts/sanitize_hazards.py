"""Attribute the hazards of a compute-sanitizer racecheck log (scripts/sanitize.sh) to kernels.

    python scripts/sanitize_hazards.py LOG

Prints one line: "<n> in this project's kernels, <m> in others (<kernel>: <count>, ...)". A hazard is
this project's when either of its two threads (the "Read Thread ... at KERNEL+offset" and "Write
Thread ..." lines racecheck prints under each "Potential ... hazard detected") runs one of this
project's kernels, whose names hold "selscan". Needs the log printed without a limit
(--print-limit 0), or hazards past the limit go unattributed; the count printed says how many were.
"""
import re
import sys
from collections import Counter

_HAZARD = re.compile(r"Potential \w+ hazard detected")
_THREAD = re.compile(r"(?:Read|Write) Thread \([^)]*\) at (.+?)\+0x[0-9a-f]+")
_TOTAL = re.compile(r"RACECHECK SUMMARY: (\d+) hazards displayed \((\d+) errors")


def attribute(lines):
    """(hazards in this project's kernels, Counter of the other kernels' hazards, hazards not printed)."""
    ours, others, current, shown, total = 0, Counter(), None, 0, 0
    for line in list(lines) + ["Potential END hazard detected"]:
        if _HAZARD.search(line):
            if current is not None:
                shown += 1
                if any("selscan" in k for k in current):
                    ours += 1
                else:
                    others[current[0] if current else "unknown"] += 1
            current = []
        elif current is not None and (m := _THREAD.search(line)):
            current.append(m.group(1).strip())
        if m := _TOTAL.search(line):
            total += int(m.group(1))  # one summary per process
    return ours, others, max(0, total - shown)


def main():
    with open(sys.argv[1], errors="replace") as f:
        ours, others, unseen = attribute(f)
    rest = ", ".join(f"{k}: {n}" for k, n in others.most_common())
    line = f"{ours} in this project's kernels, {sum(others.values())} in others" + (f" ({rest})" if rest else "")
    if unseen:
        line += f", {unseen} not printed (not attributed)"
    print(line)


if __name__ == "__main__":
    main()
