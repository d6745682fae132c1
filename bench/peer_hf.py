"""Benchmark peer: Hugging Face transformers `generate` in static batches.

All requests arrive at t=0; batches of `batch` run one after another, each padded on the
left and generating up to its longest `max_new_tokens` (EOS suppressed, as kvserve's
`ignore_eos`). A request's tokens count only up to its own limit; its first token is
the end of its batch's prefill, timed with a logits processor.
Reads a workload JSON, writes a result JSON (per-request TTFT/e2e/tokens, wall, peak RSS).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList


class _FirstCall(LogitsProcessor):
    def __init__(self, eos: int) -> None:
        self.first: float | None = None
        self.eos = eos

    def __call__(self, input_ids, scores):
        if self.first is None:
            self.first = time.perf_counter()
        scores[:, self.eos] = -float("inf")
        return scores


def main(workload_path: str, out_path: str, batch: int, dtype: str, threads: int) -> None:
    torch.set_num_threads(threads)
    spec = json.loads(Path(workload_path).read_text())
    model_path = Path(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, torch_dtype=torch.float32
    ).to(getattr(torch, dtype)).eval()
    eos = int(spec["eos_token_id"])
    pad = eos
    requests = spec["requests"]
    records: list[dict] = []
    t0 = time.perf_counter()
    for b0 in range(0, len(requests), batch):
        group = requests[b0:b0 + batch]
        width = max(len(r["token_ids"]) for r in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for i, r in enumerate(group):
            n = len(r["token_ids"])
            ids[i, width - n:] = torch.tensor(r["token_ids"])
            mask[i, width - n:] = 1
        start = time.perf_counter() - t0
        first = _FirstCall(eos)
        new = max(r["max_new_tokens"] for r in group)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad,
                           logits_processor=LogitsProcessorList([first]))
        end = time.perf_counter() - t0
        ft = (first.first or time.perf_counter()) - t0
        for r in group:
            records.append({"start": 0.0, "first_token": ft, "end": end,
                            "output_tokens": r["max_new_tokens"], "batch_start": start})
    wall = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    Path(out_path).write_text(json.dumps({"records": records, "wall_s": wall, "peak_rss_mib": peak_kib / 1024}))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
