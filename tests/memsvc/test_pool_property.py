"""Property test: random admit / decode / grow / commit / release / evict / client-death
sequences against an in-process Pool, checking the invariants after every step and that
every prefix hit hands out slots holding the KV of exactly that prefix."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.memsvc.integrity import check_integrity
from kvserve.memsvc.policy import make_policy
from kvserve.memsvc.pool import ItemError, Pool
from kvserve.messages.runner_memsvc import Admit, Commit, Grow, Release

SYSTEM = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 9, 9, 9]]
SIZE, MAX_CTX = 48, 24


@dataclass
class Req:
    lease: int
    request_id: int
    row: int
    tokens: list[int]
    computed: int
    capacity: int


def kv_value(tokens: list[int], pos: int) -> int:
    return hash(tuple(tokens[: pos + 1])) % (1 << 40)


def write_kv(pool: Pool, kv: np.ndarray, req: Req, start: int, end: int) -> None:
    slots = pool.req_to_token[req.row, start:end].numpy()
    for i, slot in enumerate(slots):
        kv[slot] = kv_value(req.tokens, start + i)


@settings(max_examples=35, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 10**6)), max_size=40),
       page_size=st.sampled_from([1, 2]), policy=st.sampled_from(["reserve", "optimistic"]))
def test_random_sequences_keep_invariants(ops: list[tuple[int, int]], page_size: int, policy: str) -> None:
    pool = Pool(size=SIZE, page_size=page_size, max_reqs=4, max_context_len=MAX_CTX,
                policy=make_policy(policy, 4), req_to_token=torch.zeros(4, MAX_CTX, dtype=torch.int32))
    kv = np.zeros(SIZE, dtype=np.int64)
    leases, next_lease, next_rid = [1, 2], 3, 0
    reqs: list[Req] = []
    for op, seed in ops:
        rng = random.Random(seed)
        if op == 0:  # admit
            lease = rng.choice(leases)
            tokens = rng.choice(SYSTEM)[: rng.randint(1, 6)] + [rng.randint(1, 4) for _ in range(rng.randint(0, 4))]
            res = pool.admit(lease, Admit(next_rid, tokens, rng.randint(0, 6)))
            if res.ok:
                req = Req(lease, next_rid, res.row, tokens, res.cached_len, res.capacity)
                cached = pool.req_to_token[res.row, : res.cached_len].numpy()
                assert [int(kv[s]) for s in cached] == [kv_value(tokens, i) for i in range(res.cached_len)]
                assert res.capacity >= len(tokens)
                write_kv(pool, kv, req, res.cached_len, len(tokens))
                req.computed = len(tokens)
                reqs.append(req)
            next_rid += 1
        elif op == 1 and reqs:  # decode one token (grow first when full)
            req = rng.choice(reqs)
            if req.computed >= req.capacity and req.capacity < MAX_CTX:
                g = pool.grow(req.lease, Grow(req.request_id, req.capacity + 1))
                req.capacity = g.capacity
            if req.computed < req.capacity:
                req.tokens.append(rng.randint(1, 4))
                write_kv(pool, kv, req, req.computed, req.computed + 1)
                req.computed += 1
        elif op == 2 and reqs:  # commit
            req = rng.choice(reqs)
            pool.commit(req.lease, Commit(req.request_id, req.tokens[: req.computed]))
        elif op == 3 and reqs:  # release, with or without a final commit
            req = reqs.pop(rng.randrange(len(reqs)))
            final = req.tokens[: req.computed] if seed % 2 else None
            pool.release(req.lease, Release(req.request_id, final))
        elif op == 4:  # client death: nothing uncommitted may enter the tree
            lease = rng.choice(leases)
            before = pool.cached_slots
            pool.drop_lease(lease)
            assert pool.cached_slots == before
            reqs = [r for r in reqs if r.lease != lease]
            leases[leases.index(lease)] = next_lease
            next_lease += 1
        elif op == 5:
            pool.evict(rng.randint(1, 20))
        elif op == 6 and reqs:  # invalid items change nothing
            req = rng.choice(reqs)
            snapshot = (pool.free_slots, pool.request_slots, pool.cached_slots)
            for bad in (lambda r=req: pool.release(r.lease + 1000, Release(r.request_id)),
                        lambda r=req: pool.grow(r.lease, Grow(r.request_id, MAX_CTX + 1)),
                        lambda r=req: pool.commit(r.lease, Commit(r.request_id, r.tokens + [1] * MAX_CTX))):
                try:
                    bad()
                    raise AssertionError("invalid item accepted")
                except ItemError:
                    pass
            assert snapshot == (pool.free_slots, pool.request_slots, pool.cached_slots)
        assert check_integrity(pool, repair=False) == []
        for req in reqs:  # the KV a live request computed is still there
            slots = pool.req_to_token[req.row, : req.computed].numpy()
            assert [int(kv[s]) for s in slots] == [kv_value(req.tokens, i) for i in range(req.computed)]
        assert pool.free_slots + pool.request_slots + pool.cached_slots == SIZE - page_size
