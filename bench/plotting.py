"""The command line the plot scripts share: records files in, a PNG path out."""

from __future__ import annotations

import json
import sys


def records_and_output(argv, usage: str) -> tuple[list[dict], str, str]:
    """(the records of every RESULTS.json in order, the first RESULTS.json, OUT.png) from
    `argv` (default sys.argv[1:]: one or more records files, then the PNG), with
    matplotlib set to draw off screen; exits with `usage` unless given at least two
    paths, and when the files hold no records."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        sys.exit(f"usage: {usage}")
    import matplotlib

    matplotlib.use("Agg")
    records = []
    for path in args[:-1]:
        with open(path) as f:
            records += json.load(f)
    if not records:
        sys.exit(f"{', '.join(args[:-1])} hold no records")
    return records, args[0], args[-1]
