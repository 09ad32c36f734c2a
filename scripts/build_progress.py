"""Shortens the output of `pip install -v` while it builds the CUDA extension (scripts/install_and_run.sh
pipes it through here, after writing all of it to a log): one line per compiled translation unit, from
the "[k/n] <compiler command>" lines that torch's ninja build prints when a file is done, with the time
since the build started; one line per extension started and linked; and, as they come, lines that
report an error and pip's final "Successfully installed". Everything else (the compiler commands,
warnings, pip's own steps) stays in the log only.

    pip install -v ... 2>&1 | tee build/install.log | python scripts/build_progress.py
"""
from __future__ import annotations

import os
import re
import sys
import time

NINJA = re.compile(r"^\s*\[(\d+)/(\d+)\]\s+(.*)$")  # ninja's status line: [finished/total] command
SOURCE = re.compile(r"\s(\S+\.(?:cu|cpp|cc|cxx|c))\s+-o\s")  # the file a compile command reads
EXTENSION = re.compile(r"^\s*building '([\w.]+)' extension")
LINK = re.compile(r"\s-shared\s.*\s-o\s+(\S+\.so)\b")
PASS = re.compile(r"\berror\b|FAILED:|^\s*ERROR|Successfully installed", re.IGNORECASE)


def source_of(command: str, root: str) -> str:
    m = SOURCE.search(command)
    if m is None:  # not a compile command of the usual form: show its tail
        return command.strip()[-80:]
    path = m.group(1)
    return os.path.relpath(path, root) if os.path.isabs(path) else path


def shorten(line: str, root: str, elapsed: float) -> str | None:
    """The line to print for one line of pip's output, or None for nothing."""
    stamp = f"{int(elapsed) // 60}:{int(elapsed) % 60:02d}"
    m = NINJA.match(line)
    if m:
        return f"  [{m.group(1)}/{m.group(2)}] {source_of(m.group(3), root)}  ({stamp})"
    m = EXTENSION.match(line)
    if m:
        return f"selscan_fused: compiling {m.group(1)}"
    m = LINK.search(line)
    if m:
        return f"  linked {os.path.basename(m.group(1))}  ({stamp})"
    if PASS.search(line):
        return line.rstrip()
    return None


def main() -> None:
    root, start = os.getcwd(), time.monotonic()
    for line in sys.stdin:
        try:
            out = shorten(line, root, time.monotonic() - start)
        except Exception:  # never stop reading: pip writes into this pipe until the build ends
            out = None
        if out is not None:
            print(out, flush=True)


if __name__ == "__main__":
    main()
