"""The accuracy summary of an ``evals.run`` result: one row per method at equal memory.

``python -m evals.summary RESULTS.json OUT.json`` writes ``{"rows": [{"method", "kv_fraction", "nll",
"passkey", "niah_mk", "full_nll", "full_passkey", "full_niah_mk", "lam", "n"}], "command", "source"}``:
``nll`` is the continuation NLL on held-out corpus rows (``nll_cont``), ``passkey`` / ``niah_mk`` the
task accuracies, ``kv_fraction`` the mean over every sample of the method, all lengths pooled; the
``full_*`` fields repeat the full cache's values on the same samples. A metric the run did not
measure is ``null``.
"""

import argparse
import json
from pathlib import Path

METHODS = ("wgkv", "streaming", "snapkv", "random", "equal_budget")
_METRICS = {"nll": ("nll", "nll_cont"), "passkey": ("passkey", "accuracy"), "niah_mk": ("niah_multikey", "accuracy")}


def _pooled(summary: list[dict], method: str, lam) -> dict:
    rows = [s for s in summary if s["length"] is None and s["method"] == method and s["lam"] == lam]
    out = {}
    for key, (ev, metric) in _METRICS.items():
        found = [s[metric] for s in rows if s["eval"] == ev and metric in s]
        out[key] = found[0] if found else None
    n = sum(s["n"] for s in rows)
    out["kv_fraction"] = sum(s["kv_fraction"] * s["n"] for s in rows) / n if n else None
    out["n"] = n
    return out


def accuracy_rows(results: dict) -> list[dict]:
    """Rows for every (method in METHODS, λ) present in ``results["summary"]``."""
    summary = results["summary"]
    full = _pooled(summary, "full", None)
    keys = sorted({(s["method"], s["lam"]) for s in summary if s["method"] in METHODS},
                  key=lambda k: (METHODS.index(k[0]), k[1] or 0))
    rows = []
    for method, lam in keys:
        r = _pooled(summary, method, lam)
        rows.append({"method": method, "kv_fraction": r["kv_fraction"], "nll": r["nll"], "passkey": r["passkey"],
                     "niah_mk": r["niah_mk"], "full_nll": full["nll"], "full_passkey": full["passkey"],
                     "full_niah_mk": full["niah_mk"], "lam": lam, "n": r["n"]})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results")
    p.add_argument("out")
    a = p.parse_args(argv)
    results = json.loads(Path(a.results).read_text())
    out = {"rows": accuracy_rows(results), "command": results.get("config", {}).get("command"),
           "source": str(a.results), "complete": results.get("complete"), "config": results.get("config")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for r in out["rows"]:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
