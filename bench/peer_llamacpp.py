"""Benchmark peer: llama-cpp-python on the same GGUF, driven by N client threads.

Runs in its own virtual environment (bench/compare.py builds it), so it imports nothing
from kvserve. llama-cpp-python's Python API runs one sequence at a time: the client
threads share one `Llama` behind a lock, which is how its own server serves them too.
Reads a workload JSON, writes a result JSON (per-request TTFT/e2e/tokens, wall, peak RSS).
"""

from __future__ import annotations

import json
import resource
import sys
import threading
import time


def main(workload_path: str, out_path: str, concurrency: int, threads: int) -> None:
    from llama_cpp import Llama

    spec = json.loads(open(workload_path).read())
    llm = Llama(model_path=spec["model"], n_ctx=2048, n_threads=threads, n_batch=512,
                verbose=False, seed=0)
    eos = llm.token_eos()
    lock = threading.Lock()
    requests = spec["requests"]
    records: list[dict] = [{} for _ in requests]
    next_index = iter(range(len(requests)))
    t0 = time.perf_counter()

    def client() -> None:
        for i in next_index:
            req = requests[i]
            start = time.perf_counter() - t0
            first = None
            n = 0
            with lock:
                for _ in llm.create_completion(req["token_ids"], max_tokens=req["max_new_tokens"],
                                               temperature=0.0, stream=True,
                                               logit_bias={eos: -1e9}):
                    n += 1
                    if first is None:
                        first = time.perf_counter() - t0
                llm.reset()
            records[i] = {"start": start, "first_token": first, "end": time.perf_counter() - t0,
                          "output_tokens": n}

    workers = [threading.Thread(target=client) for _ in range(concurrency)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    json.dump({"records": records, "wall_s": wall, "peak_rss_mib": peak_kib / 1024}, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
