"""What structured outputs cost under load: the mask time per constrained row per token, and
output tokens/s at --streams streams with a JSON schema on every request against the same
requests unconstrained (issue 37, item 5: goals <= 50 us a row and >= 0.9x).

    .venv/bin/python bench/structured_cost.py [--streams 32] [--round-s 20] [--rounds 3]

Starts `kvserve serve` (the embedded default model, serve's defaults: its 4-bit codes, batch
invariant) and keeps --streams gRPC streams busy (closed loop: each thread sends its next
request as soon as the last ends), in rounds of --round-s seconds, alternating: a chat prompt
constrained to a person schema; the same prompt unconstrained with ignore_eos and as many new
tokens as the constrained answers had on average (measured in a first, warm-up round), so both
kinds of round run requests of the same shape. Output tokens are counted as they arrive inside a
round's window. The mask time comes from the runner's own metrics over the constrained rounds:
kvserve_runner_step_seconds{phase="mask"} (the masks of a step, on their thread while the
forward runs) over kvserve_runner_masked_rows_total. Prints each round, the medians and the
ratio beside the CPU's flags; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from e2e_throughput import cpu_flags
from grammar_libs import BOUNDED as SCHEMA

from kvserve.tools.servectl import start_serve, stop_serve
from kvserve.v1 import generator_pb2 as pb

MASK_SECONDS = 'kvserve_runner_step_seconds_sum{phase="mask"}'
PROMPT = "Describe a fictional person as JSON with their name, age, city and hobbies."


def _request(constrained: bool, max_new: int, seed: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0.7, seed=seed, max_new_tokens=max_new, ignore_eos=not constrained)
    if constrained:
        sampling.constraint.json_schema = json.dumps(SCHEMA)
    return pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=PROMPT)]),
                              sampling=sampling)


def _round(stub, streams: int, seconds: float, constrained: bool, max_new: int, seed0: int) -> dict:
    start = time.monotonic()
    end = start + seconds
    tokens = [0] * streams
    lengths: list[int] = []
    parsed = [0, 0]  # constrained answers that parse, and all finished ones
    lock = threading.Lock()

    def loop(i: int) -> None:
        n = 0
        while time.monotonic() < end:
            n += 1
            got, text = 0, []
            for msg in stub.Generate(_request(constrained, max_new, seed0 + i * 1000 + n), timeout=600):
                if time.monotonic() < end:
                    tokens[i] += len(msg.token_ids)
                got += len(msg.token_ids)
                text.append(msg.text)
                if msg.finish_reason and constrained:
                    with lock:
                        parsed[1] += 1
                        try:
                            json.loads("".join(text))
                            parsed[0] += 1
                        except ValueError:
                            pass
            with lock:
                lengths.append(got)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"constrained": constrained, "tok_s": sum(tokens) / seconds, "requests": len(lengths),
            "mean_len": statistics.mean(lengths) if lengths else 0.0, "parsed": parsed[0], "finished": parsed[1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--round-s", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=3, help="rounds of each kind, alternating")
    p.add_argument("--serve-args", default="", help="extra `kvserve serve` arguments")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    runtime = Path(tempfile.mkdtemp(prefix="kvs-structured-"))
    svc = start_serve(runtime / "rt", None, "--kv-tokens", "65536", *args.serve_args.split(), dtype=None,
                      device=None, ready_s=600.0)
    try:
        warm = _round(svc.stub, args.streams, args.round_s, True, 256, 0)
        max_new = max(1, round(warm["mean_len"]))
        print(f"# CPU: {cpu_flags()}; {args.streams} streams, rounds of {args.round_s:g} s")
        print(f"warm-up (constrained): {warm['tok_s']:.1f} tok/s, mean answer {warm['mean_len']:.1f} tokens, "
              f"{warm['parsed']}/{warm['finished']} parse; unconstrained rounds: {max_new} tokens each")
        rounds: list[dict] = []
        mask_s = rows = mask0 = rows0 = 0.0
        for k in range(2 * args.rounds):
            constrained = k % 2 == 1
            if constrained:
                mask0, rows0 = svc.metric(2, MASK_SECONDS), svc.metric(2, "kvserve_runner_masked_rows_total")
            r = _round(svc.stub, args.streams, args.round_s, constrained, 256 if constrained else max_new,
                       (k + 1) * 10**6)
            if constrained:
                mask_s += svc.metric(2, MASK_SECONDS) - mask0
                rows += svc.metric(2, "kvserve_runner_masked_rows_total") - rows0
            rounds.append(r)
            print(f"round {k}: {'json_schema' if constrained else 'free':11} {r['tok_s']:7.1f} tok/s, "
                  f"{r['requests']} requests, mean {r['mean_len']:.1f} tokens"
                  + (f", {r['parsed']}/{r['finished']} parse" if constrained else ""))
        free = statistics.median(r["tok_s"] for r in rounds if not r["constrained"])
        cons = statistics.median(r["tok_s"] for r in rounds if r["constrained"])
        per_row = mask_s / rows * 1e6 if rows else float("nan")
        print(f"median: free {free:.1f} tok/s, json_schema {cons:.1f} tok/s: {cons / free:.3f}x (goal >= 0.9)")
        print(f"mask time: {per_row:.1f} us per constrained row per token over {rows:.0f} rows (goal <= 50)")
        if args.json:
            Path(args.json).write_text(json.dumps({
                "cpu": cpu_flags(), "streams": args.streams, "round_s": args.round_s, "warm": warm,
                "rounds": rounds, "free_tok_s": free, "json_schema_tok_s": cons, "ratio": cons / free,
                "mask_us_per_row": per_row, "masked_rows": rows}, indent=1) + "\n")
    finally:
        stop_serve(svc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
