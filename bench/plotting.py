"""The command line the plot scripts share: a records file in, a PNG path out."""

from __future__ import annotations

import json
import sys


def records_and_output(argv, usage: str) -> tuple[list[dict], str, str]:
    """(the records of RESULTS.json, RESULTS.json, OUT.png) from `argv` (default
    sys.argv[1:]), with matplotlib set to draw off screen; exits with `usage` unless given
    exactly those two, and when the file holds no records."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.exit(f"usage: {usage}")
    import matplotlib

    matplotlib.use("Agg")
    with open(args[0]) as f:
        records = json.load(f)
    if not records:
        sys.exit(f"{args[0]} holds no records")
    return records, args[0], args[1]
