"""What `kvserve bench` reports: the per-request `Record`, the summary, its table and plot.

Pure functions over records; knows nothing of gRPC or of the server.
"""

from __future__ import annotations

import math
import re
import urllib.request
from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class Record:
    """What one request measured (times in seconds from the run's start)."""

    index: int
    prompt_tokens: int
    max_new_tokens: int
    start: float = 0.0
    first_token: float | None = None
    end: float = 0.0
    output_tokens: int = 0
    cached_tokens: int = 0
    status: str = "OK"
    finish_reason: str = ""
    token_gaps: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (linear interpolation; NaN when empty)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    f, c = math.floor(k), math.ceil(k)
    return s[f] + (s[c] - s[f]) * (k - f)


def scrape_prefix(url: str | None) -> tuple[float, float] | None:
    """(queried tokens, hit tokens) from a memsvc /metrics page, or None."""
    if not url:
        return None
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return None
    vals = {}
    for name in ("kvserve_prefix_cache_queries_total", "kvserve_prefix_cache_hits_total"):
        m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        vals[name] = float(m.group(1)) if m else 0.0
    return vals["kvserve_prefix_cache_queries_total"], vals["kvserve_prefix_cache_hits_total"]


def summarize(records: list[Record], wall: float, prefix: tuple[float, float] | None) -> dict:
    """Aggregate figures of a run (what the table prints and --json stores)."""
    ok = [r for r in records if r.status == "OK"]
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.first_token - r.start for r in ok if r.first_token is not None]
    gaps = [g for r in ok for g in r.token_gaps]
    e2e = [r.end - r.start for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    pct = {q: f"p{int(q * 100)}" for q in (0.5, 0.9, 0.99)}
    summary = {
        "requests": len(records),
        "ok": len(ok),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if wall else 0.0,
        "errors": dict(Counter(r.status for r in records if r.status != "OK")),
        "prefix_hit_rate_usage": cached / prompt if prompt else 0.0,
    }
    for name, vals in (("ttft", ttft), ("itl", gaps), ("e2e", e2e)):
        for q, tag in pct.items():
            summary[f"{name}_{tag}_s"] = percentile(vals, q)
    if prefix is not None:
        queried, hits = prefix
        summary["prefix_hit_rate_metrics"] = hits / queried if queried else 0.0
    return summary


def format_table(s: dict) -> str:
    """A plain-text table of a summary."""
    ms = lambda v: "-" if v != v else f"{v * 1000:.1f}"  # noqa: E731 (nan -> "-")
    lines = [
        f"requests        {s['ok']}/{s['requests']} ok in {s['wall_s']:.1f} s",
        f"requests/s      {s['requests_per_s']:.2f}",
        f"output tok/s    {s['output_tokens_per_s']:.1f}  ({s['output_tokens']} tokens)",
        "latency (ms)         p50      p90      p99",
    ]
    for name, label in (("ttft", "TTFT"), ("itl", "inter-token"), ("e2e", "end-to-end")):
        lines.append(f"  {label:<14}" + "".join(f"{ms(s[f'{name}_{p}_s']):>9}" for p in ("p50", "p90", "p99")))
    lines.append(f"errors          {s['errors'] or 'none'}")
    rate = s.get("prefix_hit_rate_metrics", s["prefix_hit_rate_usage"])
    source = "server metrics" if "prefix_hit_rate_metrics" in s else "usage.cached_tokens"
    lines.append(f"prefix hit rate {rate * 100:.1f} % (from {source})")
    return "\n".join(lines)


def plot(records: list[Record], path: str) -> None:
    """Write a PNG: latency CDFs (TTFT, e2e) and output tokens/s over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'kvserve[bench]'") from None
    ok = [r for r in records if r.status == "OK"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, vals in (("TTFT", [r.first_token - r.start for r in ok if r.first_token is not None]),
                       ("end-to-end", [r.end - r.start for r in ok])):
        s = sorted(vals)
        ax1.plot(s, [(i + 1) / len(s) for i in range(len(s))], label=name)
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("latency CDF")
    ax1.legend()
    end = max((r.end for r in ok), default=0.0)
    bins = max(1, int(end))
    counts = [0] * (bins + 1)
    for r in ok:
        # Spread each request's tokens evenly over its streaming time.
        first = r.first_token if r.first_token is not None else r.end
        span = max(r.end - first, 1e-9)
        for k in range(r.output_tokens):
            counts[min(bins, int(first + span * k / max(r.output_tokens, 1)))] += 1
    ax2.plot(range(len(counts)), counts)
    ax2.set_xlabel("seconds since start")
    ax2.set_ylabel("output tokens/s")
    ax2.set_title("throughput over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
