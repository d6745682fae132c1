"""The host and disk tiers below the pool (kvserve/memsvc/tiers/), in process: what leaves
the pool comes back with the same KV, the disk survives its memsvc, and a torn, corrupted,
foreign or contended file or directory is refused, never served."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve.memsvc.integrity import check_integrity
from kvserve.memsvc.policy import make_policy
from kvserve.memsvc.pool import Pool
from kvserve.memsvc.tiers import (
    SUFFIX,
    Block,
    BlockShape,
    DiskTier,
    HostTier,
    TierError,
    Tiers,
    TierSettings,
    TierStats,
    block_keys,
    identity_digest,
)
from kvserve.messages.runner_memsvc import REASON_LOADING, Admit, Release

LAYERS, HEADS, DIM, BLOCK = 2, 2, 4, 4
SIZE = 64  # pool slots (slot 0 is the dummy)


def make_pool(tmp: Path | None, host_bytes: int = 1 << 20, model: bytes = b"model-a",
              dtype: torch.dtype = torch.float32) -> tuple[Pool, Tiers, torch.Tensor, torch.Tensor]:
    k = torch.zeros(LAYERS, SIZE, HEADS, DIM, dtype=dtype)
    v = torch.zeros_like(k)
    tiers = Tiers.create(k, v, TierSettings(host_bytes=host_bytes, disk_dir=str(tmp) if tmp else "",
                                            disk_bytes=1 << 20, model=model, block_size=BLOCK))
    pool = Pool(size=SIZE, page_size=1, max_reqs=4, max_context_len=32, policy=make_policy("reserve", 4),
                req_to_token=torch.zeros(4, 32, dtype=torch.int32), tiers=tiers)
    return pool, tiers, k, v


def kv_of(tokens: list[int]) -> torch.Tensor:
    """The K values a runner 'computes' for each position: a function of the prefix."""
    out = torch.empty(LAYERS, len(tokens), HEADS, DIM)
    for i in range(len(tokens)):
        out[:, i] = float(sum(tokens[: i + 1]) % 997) + torch.arange(LAYERS * HEADS * DIM).view(LAYERS, HEADS, DIM)
    return out


def run(pool: Pool, k: torch.Tensor, v: torch.Tensor, rid: int, tokens: list[int]) -> int:
    """Admit, 'compute' the uncached KV into the row's slots, release with a commit; the cached length."""
    res = pool.admit(1, Admit(rid, tokens, 1))
    assert res.ok, res
    slots = torch.from_numpy(pool.rows[(1, rid)].slots[: len(tokens)].copy())
    kv = kv_of(tokens)
    k[:, slots[res.cached_len:]] = kv[:, res.cached_len:].to(k.dtype)
    v[:, slots[res.cached_len:]] = -kv[:, res.cached_len:].to(k.dtype)
    pool.release(1, Release(rid, tokens))
    return res.cached_len


def held_kv(pool: Pool, k: torch.Tensor, v: torch.Tensor, rid: int, tokens: list[int], upto: int) -> None:
    """Admit `tokens` and check the first `upto` positions' KV in the row's slots is the computed one."""
    res = pool.admit(1, Admit(rid, tokens, 1))
    assert res.ok and res.cached_len == upto, res
    slots = torch.from_numpy(pool.rows[(1, rid)].slots[:upto].copy())
    want = kv_of(tokens)[:, :upto].to(k.dtype)
    assert torch.equal(k[:, slots], want) and torch.equal(v[:, slots], -want)
    pool.release(1, Release(rid, None))


PROMPT = list(range(1, 22))  # 21 tokens: 5 whole blocks of the 20 the cache can match


def evict_all(pool: Pool) -> None:
    pool.evict(SIZE)
    assert pool.cached_slots == 0


def test_an_evicted_prefix_comes_back_from_host_memory_with_its_kv() -> None:
    pool, tiers, k, v = make_pool(None)
    assert run(pool, k, v, 0, PROMPT) == 0
    evict_all(pool)
    assert len(tiers.host.blocks) == 5  # positions 0..19: the 21st is no whole block
    k.zero_()
    v.zero_()  # the pool forgot everything
    held_kv(pool, k, v, 1, PROMPT, 20)
    assert tiers.stats.hits == {"host": 20, "disk": 0}
    assert check_integrity(pool) == []


def test_a_partial_pool_hit_takes_the_rest_from_the_host_tier() -> None:
    pool, tiers, k, v = make_pool(None)
    run(pool, k, v, 0, PROMPT)
    pool.evict(9)  # the leaf goes whole: positions 0..21 in one node, all evicted
    run(pool, k, v, 1, PROMPT[:6] + [99, 98])  # positions 0..5 cached again from the host tier
    assert tiers.stats.hits["host"] == 4  # one block; positions 4, 5 computed
    held_kv(pool, k, v, 2, PROMPT, 20)  # 0..7 in the pool (6 of them now), the rest from the host
    assert check_integrity(pool) == []


def test_host_tier_drops_its_least_recent_block_at_its_bound() -> None:
    shape = BlockShape(LAYERS, HEADS, DIM, "float32", BLOCK)
    host = HostTier(3 * shape.kv_bytes)
    blocks = {bytes([i]) * 32: Block(torch.full((LAYERS, BLOCK, HEADS, DIM), float(i)),
                                     torch.zeros(LAYERS, BLOCK, HEADS, DIM)) for i in range(4)}
    keys = list(blocks)
    for key in keys[:3]:
        host.put(key, blocks[key])
    host.get(keys[0])  # now the most recent
    host.put(keys[3], blocks[keys[3]])
    assert list(host.blocks) == [keys[2], keys[0], keys[3]]
    assert host.bytes == 3 * shape.kv_bytes


def test_keys_chain_from_the_model_and_the_whole_prefix() -> None:
    shape = BlockShape(LAYERS, HEADS, DIM, "float32", BLOCK)
    a = identity_digest(b"model-a", shape)
    tokens = np.arange(1, 13)
    ka = block_keys(a, tokens, BLOCK, 3)
    assert len(set(ka)) == 3
    other = tokens.copy()
    other[0] = 50  # same last two blocks, another first one
    assert block_keys(a, other, BLOCK, 3)[1:] != ka[1:]
    assert block_keys(identity_digest(b"model-b", shape), tokens, BLOCK, 3)[0] != ka[0]
    bf16 = BlockShape(LAYERS, HEADS, DIM, "bfloat16", BLOCK)
    assert block_keys(identity_digest(b"model-a", bf16), tokens, BLOCK, 3)[0] != ka[0]


def admit_after_loading(pool: Pool, rid: int, tokens: list[int]) -> object:
    """Admit until the disk reads are done (the first answer must be 'loading')."""
    res = pool.admit(1, Admit(rid, tokens, 1))
    assert not res.ok and res.reason == REASON_LOADING, res
    end = time.monotonic() + 10
    while not res.ok and time.monotonic() < end:
        time.sleep(0.01)
        res = pool.admit(1, Admit(rid, tokens, 1))
    assert res.ok, res
    return res


def test_the_disk_tier_outlives_its_memsvc_and_serves_a_warm_restart(tmp_path: Path) -> None:
    pool, tiers, k, v = make_pool(tmp_path, host_bytes=0)
    run(pool, k, v, 0, PROMPT)
    assert tiers.flush()
    files = list(tmp_path.rglob(f"*{SUFFIX}"))
    assert len(files) == 5
    tiers.close()  # "memsvc" stops: pool and host memory are gone
    pool, tiers, k, v = make_pool(tmp_path, host_bytes=0)
    assert len(tiers.disk) == 5
    res = admit_after_loading(pool, 1, PROMPT)
    assert res.cached_len == 20
    slots = torch.from_numpy(pool.rows[(1, 1)].slots[:20].copy())
    want = kv_of(PROMPT)[:, :20]
    assert torch.equal(k[:, slots], want) and torch.equal(v[:, slots], -want)
    assert tiers.stats.hits == {"host": 0, "disk": 20}
    assert check_integrity(pool) == []
    tiers.close()


def test_bfloat16_blocks_round_trip_through_disk(tmp_path: Path) -> None:
    pool, tiers, k, v = make_pool(tmp_path, host_bytes=0, dtype=torch.bfloat16)
    run(pool, k, v, 0, PROMPT)
    assert tiers.flush()
    tiers.close()
    pool, tiers, k, v = make_pool(tmp_path, host_bytes=0, dtype=torch.bfloat16)
    res = admit_after_loading(pool, 1, PROMPT)
    slots = torch.from_numpy(pool.rows[(1, 1)].slots[:20].copy())
    assert res.cached_len == 20 and torch.equal(k[:, slots], kv_of(PROMPT)[:, :20].to(torch.bfloat16))
    tiers.close()


def test_another_model_never_hits_the_blocks_of_the_first(tmp_path: Path) -> None:
    pool, tiers, k, v = make_pool(tmp_path, host_bytes=0)
    run(pool, k, v, 0, PROMPT)
    assert tiers.flush()
    tiers.close()
    pool, tiers, k, v = make_pool(tmp_path, host_bytes=0, model=b"model-b")
    assert len(tiers.disk) == 0
    res = pool.admit(1, Admit(1, PROMPT, 1))
    assert res.ok and res.cached_len == 0
    tiers.close()
    assert len(list(tmp_path.rglob(f"*{SUFFIX}"))) == 5  # model a's files are left alone


def test_flipped_byte_torn_file_and_leftover_temporary_are_dropped_not_served(tmp_path: Path) -> None:
    pool, tiers, k, v = make_pool(tmp_path, host_bytes=0)
    run(pool, k, v, 0, PROMPT)
    assert tiers.flush()
    tiers.close()
    keys = block_keys(tiers.identity, np.array(PROMPT), BLOCK, 5)
    files = [tiers.disk.dir / (key.hex() + SUFFIX) for key in keys]
    data = bytearray(files[2].read_bytes())
    data[len(data) // 2] ^= 0x40  # a flipped bit in block 2's K or V
    files[2].write_bytes(bytes(data))
    with open(files[4], "r+b") as fh:  # killed mid-write: block 4 is short
        fh.truncate(100)
    (tiers.disk.dir / (files[3].name + ".tmp123")).write_bytes(b"half")
    pool, tiers, k, v = make_pool(tmp_path, host_bytes=0)
    assert len(tiers.disk) == 4 and not files[4].exists()
    assert tiers.stats.errors == {"torn": 2}
    res = admit_after_loading(pool, 1, PROMPT)
    assert res.cached_len == 8  # blocks 0, 1; block 2 failed its checksum
    assert not files[2].exists() and tiers.stats.errors == {"torn": 2, "corrupt": 1}
    slots = torch.from_numpy(pool.rows[(1, 1)].slots[:8].copy())
    assert torch.equal(k[:, slots], kv_of(PROMPT)[:, :8])
    tiers.close()


def test_a_second_memsvc_on_one_directory_is_refused(tmp_path: Path) -> None:
    _, tiers, _, _ = make_pool(tmp_path, host_bytes=0)
    with pytest.raises(TierError, match=f"--disk-cache-dir {tmp_path}: another memsvc uses this directory"):
        make_pool(tmp_path, host_bytes=0)
    tiers.close()
    make_pool(tmp_path, host_bytes=0)[1].close()  # free again once the first is gone


def test_disk_bound_deletes_the_least_recent_files(tmp_path: Path) -> None:
    shape = BlockShape(LAYERS, HEADS, DIM, "float32", BLOCK)
    stats = TierStats()
    disk = DiskTier(tmp_path, 3 * shape.file_bytes, identity_digest(b"m", shape), shape, stats)
    blk = Block(torch.ones(LAYERS, BLOCK, HEADS, DIM), torch.zeros(LAYERS, BLOCK, HEADS, DIM))
    keys = [bytes([i]) * 32 for i in range(5)]
    for i, key in enumerate(keys):
        assert disk.write(key, i, np.arange(BLOCK), blk)
    assert list(disk.index) == keys[2:] and disk.bytes == 3 * shape.file_bytes
    assert sorted(p.name for p in disk.dir.iterdir()) == sorted(key.hex() + SUFFIX for key in keys[2:])
    disk.close()


def test_a_failing_disk_is_counted_and_the_pool_goes_on(tmp_path: Path) -> None:
    pool, tiers, k, v = make_pool(tmp_path, host_bytes=1 << 20)
    d = tiers.disk.dir
    os.rmdir(d)
    d.write_bytes(b"")  # the tier's directory is now a file: every write fails
    run(pool, k, v, 0, PROMPT)
    assert tiers.flush()
    assert tiers.stats.errors.get("write") == 5 and len(tiers.disk) == 0
    evict_all(pool)
    held_kv(pool, k, v, 1, PROMPT, 20)  # the host tier still serves
    tiers.close()


def test_kv_events_tell_the_router_which_medium_holds_each_block(tmp_path: Path) -> None:
    from kvserve.memsvc.kv_events import BlockEvents
    from kvserve.messages.kv_events import BlockRemoved, BlockStored

    def events(pool: Pool, tiers: Tiers, ev: BlockEvents) -> list[tuple[str, str, list[bytes], bytes | None]]:
        tiers.poll_events()
        return [(type(e).__name__, e.medium, e.block_hashes, getattr(e, "parent_block_hash", None))
                for e in ev.take() if isinstance(e, BlockStored | BlockRemoved)]

    def with_events(pool: Pool, tiers: Tiers) -> BlockEvents:
        ev = BlockEvents(BLOCK)
        pool.tree.listener = ev
        tiers.tell(ev)
        return ev

    pool, tiers, k, v = make_pool(tmp_path, host_bytes=3 * BlockShape(LAYERS, HEADS, DIM, "float32", BLOCK).kv_bytes)
    ev = with_events(pool, tiers)
    run(pool, k, v, 0, PROMPT)
    assert tiers.flush()
    _, hashes = ev.chain(np.array(PROMPT), 0, 5)
    got = events(pool, tiers, ev)
    assert got[0] == ("BlockStored", "GPU", hashes, None)
    assert sorted(got[1:], key=lambda e: hashes.index(e[2][0])) == [
        ("BlockStored", "DISK", [h], hashes[i - 1] if i else None) for i, h in enumerate(hashes)]
    evict_all(pool)
    got = events(pool, tiers, ev)
    assert got[0] == ("BlockRemoved", "GPU", hashes, None)
    cpu = got[1:]  # 5 blocks into a host tier of 3: the first two in, then out again
    stored = [e[2][0] for e in cpu if e[0] == "BlockStored"]
    removed = [h for e in cpu if e[0] == "BlockRemoved" for h in e[2]]
    assert all(e[1] == "CPU" for e in cpu) and stored == hashes and removed == hashes[:2]
    tiers.close()
    pool, tiers, k, v = make_pool(tmp_path, host_bytes=0)  # a warm restart announces the disk's blocks
    ev = with_events(pool, tiers)
    end = time.monotonic() + 10
    got: list = []
    while len(got) < 5 and time.monotonic() < end:
        got += events(pool, tiers, ev)
        time.sleep(0.01)
    assert got == [("BlockStored", "DISK", [h], hashes[i - 1] if i else None) for i, h in enumerate(hashes)]
    tiers.close()


def test_config_checks_the_tier_settings() -> None:
    from kvserve.config import ConfigError
    from kvserve.config.memsvc import MemsvcConfig

    assert MemsvcConfig(host_cache_bytes="2GiB", disk_cache_dir="/x").disk_cache_bytes == "16GiB"
    with pytest.raises(ConfigError, match="--host-cache-bytes: not a size: 'lots'"):
        MemsvcConfig(host_cache_bytes="lots")
    with pytest.raises(ConfigError, match="--disk-cache-dir keys its blocks by the model file's hash"):
        MemsvcConfig(n_layers=2, n_kv_heads=2, head_dim=8, disk_cache_dir="/x")


def test_no_blocks_are_copied_in_for_a_row_the_pool_cannot_hold_now() -> None:
    pool, tiers, k, v = make_pool(None)
    run(pool, k, v, 0, PROMPT)
    evict_all(pool)
    for rid in (1, 2):  # two rows hold 42 of the 63 slots: 20 for the blocks, not 22 for the row
        assert pool.admit(1, Admit(rid, list(range(100 * rid, 100 * rid + 20)), 1)).ok
    res = pool.admit(1, Admit(3, PROMPT, 1))
    assert not res.ok and res.reason == "exhausted"
    assert tiers.stats.hits["host"] == 0 and pool.cached_slots == 0
    pool.release(1, Release(1, None))
    held_kv(pool, k, v, 4, PROMPT, 20)
    assert tiers.stats.hits["host"] == 20
