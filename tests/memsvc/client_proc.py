"""A stand-in runner process for the memsvc integration tests.

usage: client_proc.py ADDRESS (write|read|hold) NAME — prints one JSON line of results.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvserve.memsvc.client import Admit, MemClient, Release

PROMPT = list(range(100, 120))


def kv_values(n: int) -> torch.Tensor:
    """What the writer stores for position i: a value unique to (layer, position, head, dim)."""
    base = torch.arange(n, dtype=torch.float32)[None, :, None, None]
    return base + torch.arange(2, dtype=torch.float32)[:, None, None, None] * 1000 + \
        torch.arange(2 * 8, dtype=torch.float32).view(1, 1, 2, 8) / 100


def main() -> int:
    address, mode, name = sys.argv[1:4]
    client = MemClient(address, name=name, timeout_s=10.0)
    layout = client.attach(n_layers=2, n_kv_heads=2, head_dim=8, dtype="float32")
    reply = client.step(admit=[Admit(request_id=7, token_ids=PROMPT, max_new_tokens=4)])
    res = reply.admitted[0]
    out = {"ok": res.ok, "cached_len": res.cached_len, "capacity": res.capacity, "size": layout.size}
    slots = client.req_to_token[res.row, : len(PROMPT)].long()
    if mode == "write":
        client.k_buffer[:, slots] = kv_values(len(PROMPT))
        client.v_buffer[:, slots] = -kv_values(len(PROMPT))
        client.step(release=[Release(request_id=7, token_ids=PROMPT)])
    elif mode == "read":
        n = res.cached_len
        out["k_equal"] = bool(torch.equal(client.k_buffer[:, slots[:n]], kv_values(len(PROMPT))[:, :n]))
        out["v_equal"] = bool(torch.equal(client.v_buffer[:, slots[:n]], -kv_values(len(PROMPT))[:, :n]))
        client.step(release=[Release(request_id=7)])
    print(json.dumps(out), flush=True)
    if mode == "hold":
        time.sleep(600)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
