"""memsvc's KV-cache events for routers: the blocks they announce follow the radix cache
exactly (a property over random inserts and evictions), their bytes are vLLM's format read
by a plain msgpack decoder, and a real memsvc process publishes them on a PUB socket with
contiguous sequence numbers and replays them on request."""

from __future__ import annotations

import hashlib
import struct
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config.curve import apply_client, apply_server, client_keys, server_keys
from kvserve.memsvc.client import Admit, MemClient, Release
from kvserve.memsvc.kv_events import BlockEvents, EventPublisher
from kvserve.memsvc.radix import RadixCache
from kvserve.messages.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
)

from .conftest import curve_keys, free_port


def chain_hash(ids: list[int] | np.ndarray) -> bytes:
    """Written apart from the code under test: SHA-256 of the ids as uint32 little-endian."""
    ids = [int(t) for t in ids]
    return hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).digest()


def cached_blocks(tree: RadixCache, b: int) -> set[bytes]:
    """The hash of every complete block of every path in the tree."""
    out = set()
    for node in tree.nodes():
        path = tree.path(node)
        out.update(chain_hash(path[: (k + 1) * b]) for k in range(len(path) // b))
    return out


class Announced:
    """What a router learns from the events, with the checks a router makes."""

    def __init__(self) -> None:
        self.blocks: set[bytes] = set()
        self.cleared = 0

    def apply(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.blocks.clear()
                self.cleared += 1
            elif isinstance(ev, BlockStored):
                assert ev.parent_block_hash is None or ev.parent_block_hash in self.blocks, \
                    "a BlockStored whose parent was never announced"
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                prev = ev.parent_block_hash
                for h in ev.block_hashes:
                    assert len(h) == 32 and h not in self.blocks, "a block announced twice"
                    self.blocks.add(h)
                    prev = h
                assert prev == ev.block_hashes[-1]
            else:
                assert isinstance(ev, BlockRemoved)
                for h in ev.block_hashes:
                    assert h in self.blocks, "a block removed that was not announced"
                    self.blocks.remove(h)


def test_hashes_chain_over_the_whole_prefix() -> None:
    ev = BlockEvents(block_size=4)
    tree = RadixCache(1, ev)
    seq = np.arange(10, 21)  # 11 tokens: two complete blocks
    tree.insert(seq, np.arange(11))
    cleared, stored = ev.take()
    assert isinstance(cleared, AllBlocksCleared)
    assert stored.parent_block_hash is None and stored.block_size == 4
    assert stored.block_hashes == [chain_hash(seq[:4]), chain_hash(seq[:8])]
    assert stored.token_ids == seq[:8].tolist()
    # extending by 5 tokens completes block 2 (its first 3 tokens were already cached) and 3
    longer = np.arange(10, 26)
    tree.insert(longer, np.arange(16))
    (ext,) = ev.take()
    assert ext.parent_block_hash == chain_hash(seq[:8])
    assert ext.block_hashes == [chain_hash(longer[:12]), chain_hash(longer[:16])]
    assert ext.token_ids == longer[8:16].tolist()
    # the same block content after another prefix is another block
    other = np.concatenate([[99], longer[1:]])
    tree.insert(other, np.arange(100, 116))
    (third,) = ev.take()
    assert third.parent_block_hash is None and chain_hash(other[:4]) == third.block_hashes[0]
    assert not set(third.block_hashes) & {chain_hash(longer[: 4 * k]) for k in range(1, 5)}
    # evicting the last 5 tokens of `longer` leaves block 2 incomplete: blocks 2 and 3 go
    tree.match_prefix(other)  # `other` is the most recent: `longer`'s tail is evicted first
    tree.evict(5)
    (removed,) = ev.take()
    assert isinstance(removed, BlockRemoved) and removed.medium == "GPU"
    assert removed.block_hashes == [chain_hash(longer[:12]), chain_hash(longer[:16])]


@settings(max_examples=150, deadline=None)
@given(pages_per_block=st.sampled_from([1, 2, 3]), page=st.sampled_from([1, 2]),
       ops=st.lists(st.one_of(
           st.tuples(st.just("insert"), st.lists(st.integers(0, 3), min_size=1, max_size=24)),
           st.tuples(st.just("evict"), st.integers(1, 30))), max_size=40))
def test_announced_blocks_are_the_complete_blocks_of_the_cache(pages_per_block: int, page: int, ops: list) -> None:
    block = pages_per_block * page  # memsvc's config requires a multiple of the page size
    ev = BlockEvents(block_size=block)
    tree = RadixCache(page, ev)
    seen = Announced()
    seen.apply(ev.take())  # memsvc starts empty: AllBlocksCleared comes first
    assert seen.cleared == 1 and not seen.blocks
    slot = 0
    for op, arg in ops:
        if op == "insert":
            ids = np.array(arg[: len(arg) - len(arg) % page], dtype=np.int64)
            if not len(ids):
                continue
            tree.insert(ids, np.arange(slot, slot + len(ids)))
            slot += len(ids)
        else:
            tree.evict(arg)
        seen.apply(ev.take())
        assert seen.blocks == cached_blocks(tree, block)
    assert seen.cleared == 1  # and never again


def test_the_wire_format_is_vllms_maps_for_a_plain_msgpack_reader() -> None:
    stored = BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=None, token_ids=[1, 2], block_size=2)
    payload = encode_batch(12.5, [AllBlocksCleared(), stored, BlockRemoved(block_hashes=[b"\x01" * 32])])
    ts, events = msgpack.unpackb(payload, raw=False)
    assert ts == 12.5
    assert events[0] == {"type": "AllBlocksCleared"}
    assert events[1] == {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
                         "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
                         "lora_name": None}
    assert events[2] == {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"}
    assert decode_batch(payload)[1][1] == stored


def _recv(sock: zmq.Socket, timeout_s: float = 10.0) -> list[bytes]:
    assert sock.poll(int(timeout_s * 1000)), "no message"
    return sock.recv_multipart()


def _events(frames: list[bytes]) -> tuple[int, list[dict]]:
    topic, seq, payload = frames
    assert topic == b""
    ts, events = msgpack.unpackb(payload, raw=False)
    assert 0 < ts <= time.time() + 1
    return struct.unpack(">q", seq)[0], events


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", struct.pack(">Q", start)])
        out = []
        while True:
            frames = _recv(dealer)
            assert frames[0] == b""
            if frames[2] == b"\xff" * 8:
                assert frames[1:] == [b"", b"\xff" * 8, b""], "the end marker has an empty topic and payload"
                return out
            out.append(frames[1:])
    finally:
        dealer.close()


@pytest.mark.timeout(90)
def test_memsvc_publishes_and_replays(run_dir: Path, memsvc_factory) -> None:
    live, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    with memsvc_factory(run_dir, "--kv-events-endpoint", live, "--kv-events-replay-endpoint", replay,
                        "--kv-event-block-size", "4") as svc:
        sub.connect(live)
        time.sleep(0.3)  # the subscription reaches the PUB socket
        client = MemClient(svc.address, name="events", timeout_s=10)
        try:
            client.attach(n_layers=2, n_kv_heads=2, head_dim=8, dtype="float32")
            prompt = list(range(100, 118))  # 18 tokens: 4 complete blocks of 4
            client.step(admit=[Admit(request_id=1, token_ids=prompt, max_new_tokens=2)])
            client.step(release=[Release(request_id=1, token_ids=prompt)])
            # the AllBlocksCleared sent at start went out before anyone listened: live from 1
            seq, events = _events(_recv(sub))
            assert seq >= 1
            stored = [e for e in events if e["type"] == "BlockStored"]
            assert len(stored) == 1 and stored[0]["parent_block_hash"] is None
            assert stored[0]["block_hashes"] == [chain_hash(prompt[: 4 * k]) for k in range(1, 5)]
            assert stored[0]["token_ids"] == prompt[:16] and stored[0]["medium"] == "GPU"
            # a replay from 0 starts with AllBlocksCleared, contiguous up to the live seq
            replayed = _replay(ctx, replay, 0)
            seqs = [struct.unpack(">q", f[1])[0] for f in replayed]
            assert seqs == list(range(seq + 1))
            assert _events(replayed[0])[1] == [{"type": "AllBlocksCleared"}]
            assert replayed[-1] == [b"", struct.pack(">q", seq), replayed[-1][2]]
            assert _events(replayed[-1])[1] == events
            # a malformed replay request is dropped; the socket and memsvc go on
            bad = ctx.socket(zmq.DEALER)
            bad.setsockopt(zmq.LINGER, 0)
            bad.connect(replay)
            bad.send_multipart([b"", b"\x00" * 3])
            bad.send_multipart([b"not empty", b"\x00" * 8])
            assert not bad.poll(500)
            bad.close()
            assert _replay(ctx, replay, seq)[0][1] == struct.pack(">q", seq)
            # eviction: five new prompts of 62 slots need more than the 256-slot pool holds
            # beside the cached 18, so the cached blocks are pushed out
            fill = [Admit(request_id=10 + i, token_ids=list(range(1000 + 100 * i, 1060 + 100 * i)),
                          max_new_tokens=2) for i in range(5)]
            client.step(admit=fill)
            removed = []
            while not removed:
                removed = [e for e in _events(_recv(sub))[1] if e["type"] == "BlockRemoved"]
            assert [h for e in removed for h in e["block_hashes"]] == stored[0]["block_hashes"]
            client.step(release=[Release(request_id=a.request_id) for a in fill])
        finally:
            client.close()
        text = svc.metrics()
        assert 'kvserve_memsvc_bad_messages_total{reason="malformed"} 2.0' in text  # the two bad replays
        assert 'kvserve_memsvc_kv_event_messages_total{outcome="sent"}' in text
        assert 'kvserve_memsvc_kv_event_blocks_total{type="BlockStored"} 4.0' in text
        assert svc.stop() == 0
    sub.close()
    ctx.term()


def test_events_over_curve_reach_only_listed_keys(tmp_path: Path) -> None:
    """Off loopback, memsvc's event sockets are CURVE servers under its ZAP handler: a listed
    key gets the replay, an unlisted key and a plain client get nothing."""
    keydir, allowed = curve_keys(tmp_path, "router") / "keys", tmp_path / "allowed"
    keys = server_keys(str(keydir / "memsvc.key_secret"), str(allowed), secret_field="curve_secret_key_file",
                       dir_field="curve_public_keys_dir")
    ctx = zmq.Context()
    anchor = ctx.socket(zmq.ROUTER)  # memsvc's own socket: starts the context's ZAP handler
    anchor.linger = 0
    apply_server(anchor, ctx, keys, name="memsvc")
    anchor.bind(f"tcp://127.0.0.1:{free_port()}")
    live, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    publisher = EventPublisher(ctx, live, replay, curve=keys)
    publisher.publish([AllBlocksCleared()])

    def ask(name: str | None) -> list[bytes] | None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        if name is not None:
            apply_client(dealer, client_keys(str(keydir / f"{name}.key_secret"), str(keydir / "memsvc.key"),
                                             secret_field="curve_secret_key_file",
                                             server_field="memsvc_public_key_file"))
        dealer.connect(replay)
        dealer.send_multipart([b"", struct.pack(">Q", 0)])
        try:
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                publisher.serve_replays()
                if dealer.poll(50):
                    return dealer.recv_multipart()
            return None
        finally:
            dealer.close(0)

    try:
        first = ask("router")
        assert first is not None and first[:3] == [b"", b"", struct.pack(">q", 0)]
        assert decode_batch(first[3])[1] == [AllBlocksCleared()]
        assert ask("stranger") is None
        assert ask(None) is None
    finally:
        publisher.close()
        anchor.close(0)
        ctx.term()
