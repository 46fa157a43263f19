"""A served run's prefill forwards under load, from SGLang's own ``Prefill batch`` lines (one a
prefill-carrying forward: ``#new-token: N, ... #running-req: R, #queue-req: Q, ... input throughput
(token/s): X``, X being the prompt tokens since the line before over the time since it).

While requests wait (``Q > 0``) and a forward is full (at least :data:`FULL` of the largest one's
new tokens), an engine prefills as fast as it can, and X is its prefill rate under its own load,
decode rows and host included: the number an isolated pass's profile cannot give
(``docs/performance.md``, M1D's burst). Smaller forwards are left out: once the pool binds, upstream
admits a prompt between decode steps, and X then counts those steps too. X also counts the decode
forwards a scheduler runs between two full ones (WG-KV's running knee holding new requests), so the
upper quartile is the back-to-back forwards' rate and the lower one shows the holds.
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
import sys

FULL = 0.9
# Running requests at a forward, in bands (label, from, below): the decode rows a mixed forward carries
# (WG-KV's) grow with them, so two engines' rates compare band by band (``by_running``).
RUNNING_BANDS = (("0-49", 0, 50), ("50-99", 50, 100), ("100-199", 100, 200), ("200+", 200, float("inf")))
LINE = re.compile(
    r"Prefill batch, #new-seq: (\d+), #new-token: (\d+),.*?#running-req: (\d+), #queue-req: (\d+),"
    r".*?input throughput \(token/s\): ([\d.]+)"
)


def prefill_under_load(log: str) -> dict | None:
    """Quartiles of the prompt tokens a second, the median new tokens and running requests over the
    full prefill forwards logged while requests waited, how many there were, and the median rate in
    each band of running requests that has any (``by_running``); None when no such line is in
    ``log``."""
    rows = [
        (int(m[2]), int(m[3]), float(m[5]))
        for m in (LINE.search(line) for line in log.splitlines())
        if m and int(m[4]) > 0
    ]
    largest = max((r[0] for r in rows), default=0)
    rows = [r for r in rows if r[0] >= FULL * largest]
    if not rows:
        return None
    rates = [r[2] for r in rows]
    low, mid, high = statistics.quantiles(rates, n=4) if len(rates) > 1 else rates * 3
    bands = {}
    for label, lo, hi in RUNNING_BANDS:
        band = [r[2] for r in rows if lo <= r[1] < hi]
        if band:
            bands[label] = {"forwards": len(band), "median": statistics.median(band)}
    return {
        "forwards": len(rows),
        "prompt_tok_s": {"p25": low, "median": mid, "p75": high},
        "new_tokens_median": statistics.median(r[0] for r in rows),
        "running_median": statistics.median(r[1] for r in rows),
        "by_running": bands,
    }


def main(argv=None) -> None:
    for path in argv if argv is not None else sys.argv[1:]:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", errors="replace") as f:
            print(json.dumps({"log": path, "prefill_under_load": prefill_under_load(f.read())}))


if __name__ == "__main__":
    main()
