"""Logic of the `kvserve bench` load generator (the live run is in tests/test_bench_live.py)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve.tools.bench import _parse_range, build_parser, make_workloads
from kvserve.tools.bench_report import Record, format_table, plot, summarize


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_ranges() -> None:
    assert _parse_range("32:512", "x") == (32, 512)
    assert _parse_range("7", "x") == (7, 7)
    for bad in ("0", "9:3", "a", "1:2:3"):
        with pytest.raises(ValueError, match="--x"):
            _parse_range(bad, "x")


def test_workloads_lengths_and_shared_prefix() -> None:
    args = _args("--prompt-len", "10:20", "--output-len", "5:9", "--shared-prefix", "2", "--prefix-len", "16")
    work = make_workloads(args, vocab_size=5000, n=50)
    assert len(work) == 50
    assert all(26 <= len(w.token_ids) <= 36 and 5 <= w.max_new_tokens <= 9 for w in work)
    assert all(1000 <= t < 5000 for w in work for t in w.token_ids)
    prefixes = {tuple(w.token_ids[:16]) for w in work}
    assert len(prefixes) == 2
    again = make_workloads(args, vocab_size=5000, n=50)
    assert [w.token_ids for w in again] == [w.token_ids for w in work]


def test_prompts_file(tmp_path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hi", "max_new_tokens": 3}) + "\n\n" + json.dumps({"prompt": "yo"}) + "\n")
    work = make_workloads(_args("--prompts-file", str(f), "--output-len", "4"), 100, 3)
    assert [(w.text, w.max_new_tokens) for w in work] == [("hi", 3), ("yo", 4), ("hi", 3)]
    f.write_text("{not json\n")
    with pytest.raises(ValueError, match="p.jsonl:1"):
        make_workloads(_args("--prompts-file", str(f)), 100, 1)


def test_summary_figures(tmp_path) -> None:
    recs = [
        Record(0, 10, 4, start=0.0, first_token=0.1, end=0.4, output_tokens=4,
               cached_tokens=5, token_gaps=[0.1, 0.1, 0.1]),
        Record(1, 10, 4, start=0.0, first_token=0.3, end=0.6, output_tokens=4,
               cached_tokens=0, token_gaps=[0.1, 0.1, 0.1]),
        Record(2, 10, 4, start=0.0, end=0.1, status="UNAVAILABLE"),
    ]
    s = summarize(recs, wall=2.0, prefix=(100.0, 25.0))
    assert s["ok"] == 2 and s["errors"] == {"UNAVAILABLE": 1}
    assert s["output_tokens_per_s"] == pytest.approx(4.0)
    assert s["ttft_p50_s"] == pytest.approx(0.2)
    assert s["itl_p99_s"] == pytest.approx(0.1)
    assert s["prefix_hit_rate_usage"] == pytest.approx(0.25)
    assert s["prefix_hit_rate_metrics"] == pytest.approx(0.25)
    table = format_table(s)
    assert "UNAVAILABLE" in table and "25.0 %" in table and "200.0" in table
    out = tmp_path / "p.png"
    plot(recs, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_flags_exit_2(capsys) -> None:
    from kvserve.tools.bench import main

    with pytest.raises(SystemExit) as info:
        main(["--prompt-len", "0"])
    assert info.value.code == 2
    assert "--prompt-len" in capsys.readouterr().err
