"""The disk tier (ext/disk_tier.py) on a real directory, alone and under the anchor store:
write, index, LRU, pins, and every way a file can be wrong (flipped byte, truncation,
another model's fingerprint, a half-written temporary file, another format version or TP
layout, a file under another anchor's name): each is skipped, quarantined and counted, and
never restored."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from anchorcache.ext import disk_tier
from anchorcache.ext.disk_tier import DiskTier, SlabRecord, model_fingerprint
from anchorcache.ext.slots import SlotTable
from anchorcache.ext.store import AnchorStore
from anchorcache.wire import (
    AnchorKind,
    AnchorPlan,
    AnchorRef,
    Region,
    SnapshotSpec,
    anchor_keys,
)

FP = "ab" * 16
LAYERS, HEADS, HEAD_DIM = 3, 2, 4
KV_BYTES_PER_TOKEN = LAYERS * 2 * HEADS * HEAD_DIM * 2  # bfloat16
STATE_BYTES = 128
NS = bytes(range(16))
MODEL = "tiny-model"


def rows(start: int, depth: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + start * 10 + depth)
    return torch.randn(LAYERS, 2, depth - start, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)


def state(seed: int) -> torch.Tensor:
    return torch.randint(1, 255, (STATE_BYTES,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def record(key: bytes, start: int, depth: int, parent: bytes | None = None, seed: int = 0
           ) -> SlabRecord:
    kv, st = rows(start, depth, seed), state(seed + depth)
    return SlabRecord(key, depth, start, parent, "conversation", kv, st,
                      kv.numel() * 2 + STATE_BYTES,
                      torch.arange(start, depth, dtype=torch.int64))


def tier(path: Path, budget: int = 1 << 30, fp: str = FP, **kw) -> DiskTier:
    t = DiskTier(path, fp, budget_bytes=budget, **kw)
    t.index()
    return t


def key(i: int) -> bytes:
    return bytes([i]) * 16


def files(t: DiskTier) -> list[Path]:
    return sorted(t.dir.glob("*.slab"))


def test_a_slab_written_is_indexed_and_loaded_equal_by_a_new_tier(tmp_path):
    t = tier(tmp_path)
    rec = record(key(1), 0, 12)
    t.put(rec)
    t.drain()
    assert [f.name for f in files(t)] == [f"{key(1).hex()}-12.slab"]
    assert not list(t.dir.glob("*.tmp"))
    with safe_open(str(files(t)[0]), framework="pt") as f:
        meta = f.metadata()
    assert meta["version"] == str(disk_tier.FORMAT_VERSION) and meta["fingerprint"] == FP
    assert (meta["tp_rank"], meta["tp_size"], meta["depth"], meta["start"], meta["parent"]) == \
        ("0", "1", "12", "0", "")
    t.close()

    again = tier(tmp_path)  # a restarted worker: headers only
    assert [(e.key, e.depth, e.start, e.parent) for e in again.entries()] == [(key(1), 12, 0, None)]
    got = again.load(key(1), 12)
    assert got is not None
    assert torch.equal(got.kv.view(torch.int16), rec.kv.view(torch.int16))
    assert torch.equal(got.state, rec.state) and torch.equal(got.tokens, rec.tokens)
    assert again.load(key(1), 13) is None  # the same key at another depth is a miss
    assert again.load(key(2), 12) is None
    s = again.stats()
    assert (s.files, s.loads, s.skips, s.bytes) == (1, 1, 0, files(again)[0].stat().st_size)


def test_lru_within_the_budget_keeps_pins_and_their_ancestors(tmp_path):
    t = tier(tmp_path)
    t.put(record(key(1), 0, 10))
    t.drain()
    size = files(t)[0].stat().st_size
    t.close()
    t = tier(tmp_path, budget=3 * size)
    t.put(record(key(2), 0, 10))
    t.put(record(key(3), 0, 10))
    t.drain()
    assert t.load(key(1), 10) is not None  # touched: now the newest
    t.put(record(key(4), 0, 10))
    t.drain()
    assert {e.key for e in t.entries()} == {key(1), key(3), key(4)}  # key 2 was the oldest
    assert t.stats().evictions == 1
    # a pinned leaf protects its parent; everything else goes first
    t.put(record(key(5), 10, 20, parent=key(3)))
    t.drain()
    t.pin(key(5))
    for i in (6, 7, 8):
        t.put(record(key(i), 0, 10))
        t.drain()
    kept = {e.key for e in t.entries()}
    assert {key(3), key(5)} <= kept
    assert sum(f.stat().st_size for f in files(t)) <= 3 * size + size  # the pinned may overflow
    assert {f.name.split("-")[0] for f in files(t)} == {k.hex() for k in kept}


def corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # a payload byte
    path.write_bytes(bytes(data))


def rewrite_meta(path: Path, **changes: str) -> None:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    save_file(tensors, str(path), metadata={**meta, **changes})


def test_a_flipped_payload_byte_is_caught_by_the_checksum_and_quarantined(tmp_path):
    t = tier(tmp_path)
    t.put(record(key(1), 0, 12))
    t.drain()
    corrupt_flip(files(t)[0])
    assert t.load(key(1), 12) is None
    assert t.stats().skips == 1 and t.entries() == [] and files(t) == []
    assert len(list((tmp_path / disk_tier.QUARANTINE).iterdir())) == 1


@pytest.mark.parametrize("damage", ["truncated", "other_fingerprint", "other_version",
                                    "other_tp", "renamed", "not_a_slab", "layout_lie"])
def test_a_bad_file_is_skipped_at_index_or_load_and_counted(tmp_path, damage):
    t = tier(tmp_path)
    t.put(record(key(1), 0, 12))
    t.put(record(key(2), 0, 8))
    t.drain()
    t.close()
    bad = t.dir / f"{key(1).hex()}-12.slab"
    if damage == "truncated":
        bad.write_bytes(bad.read_bytes()[:-7])
    elif damage == "other_fingerprint":  # another model's slab, copied in under our name
        other = tier(tmp_path / "other", fp="cd" * 16)
        other.put(record(key(1), 0, 12, seed=9))
        other.drain()
        shutil.copy(files(other)[0], bad)
    elif damage == "other_version":
        rewrite_meta(bad, version="2")
    elif damage == "other_tp":
        rewrite_meta(bad, tp_rank="1", tp_size="2")
    elif damage == "renamed":  # key 2's file under key 1's name: must not answer for key 1
        shutil.copy(t.dir / f"{key(2).hex()}-8.slab", bad)
    elif damage == "not_a_slab":
        bad.write_bytes(b"\x00" * 64)
    elif damage == "layout_lie":  # header shapes that do not match the tensors
        rewrite_meta(bad, layout='{"kv": ["torch.bfloat16", [3, 2, 13, 2, 4]]}')
    again = tier(tmp_path)
    assert again.load(key(1), 12) is None
    assert again.stats().skips == 1
    assert not bad.exists()
    assert (tmp_path / disk_tier.QUARANTINE).exists()
    assert again.load(key(2), 8) is not None  # the good file next to it still serves


def test_a_half_written_temporary_file_is_never_read_and_is_deleted_at_a_later_start(tmp_path):
    t = tier(tmp_path)
    t.put(record(key(1), 0, 12))
    t.drain()
    t.close()
    whole = files(t)[0]
    half = whole.with_name(f".{key(3).hex()}-12.slab.999{disk_tier.TMP_SUFFIX}")
    half.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    # another worker sharing the directory, mid-write: its temporary is left alone
    busy = whole.with_name(f".{key(4).hex()}-12.slab.998{disk_tier.TMP_SUFFIX}")
    busy.write_bytes(b"\x00" * 8)
    old = time.time() - disk_tier.STALE_TMP_S - 60
    os.utime(half, (old, old))
    again = tier(tmp_path)
    assert not half.exists() and busy.exists()
    assert [e.key for e in again.entries()] == [key(1)]
    assert again.load(key(3), 12) is None


def test_a_full_disk_turns_the_tier_off_with_one_log_line(tmp_path, monkeypatch, caplog):
    t = tier(tmp_path)

    def full(*args, **kwargs):  # a real full disk cannot be made on demand here
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "save_file", full)
    with caplog.at_level(logging.ERROR, logger="anchorcache.worker"):
        t.put(record(key(1), 0, 12))
        t.drain()
        t.put(record(key(2), 0, 12))  # off: not even queued
        t.drain()
    assert not t.enabled and t.stats().write_errors == 1
    assert [r.message for r in caplog.records if "disk tier off" in r.message].__len__() == 1
    assert files(t) == [] and not list(t.dir.glob("*.tmp"))


def test_an_unwritable_directory_turns_the_tier_off(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with caplog.at_level(logging.ERROR, logger="anchorcache.worker"):
        t = DiskTier(blocker / "sub", FP, budget_bytes=1 << 20)
    assert not t.enabled and t.index() == 0
    t.put(record(key(1), 0, 4))
    assert t.stats().writes == 0


def test_the_fingerprint_covers_config_weights_and_layout(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    fp = model_fingerprint(tmp_path, "float32")
    assert fp == model_fingerprint(tmp_path, "float32")
    assert fp != model_fingerprint(tmp_path, "bfloat16")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert fp != model_fingerprint(tmp_path, "float32")
    fp2 = model_fingerprint(tmp_path, "float32")
    (tmp_path / "config.json").write_text('{"a": 2}')
    assert fp2 != model_fingerprint(tmp_path, "float32")


# ---- under the anchor store -----------------------------------------------------------------

def store(path: Path, *, kv_bytes_per_token: int = KV_BYTES_PER_TOKEN, fp: str = FP,
          budget: int = 1 << 30) -> AnchorStore:
    return AnchorStore(MODEL, SlotTable(16, 1 << 30, pinned_slots=4),
                       kv_bytes_per_token=kv_bytes_per_token, state_bytes=STATE_BYTES,
                       disk=tier(path, budget=budget, fp=fp))


PROMPT = tuple(range(100, 160))


def write_chain(s: AnchorStore, ids: tuple[int, ...], depths: list[int]) -> dict[int, bytes]:
    keys = anchor_keys(NS, MODEL, ids, depths)
    slots = []
    for d in depths:
        w = s.write("r1", keys[d], d, AnchorKind.CONVERSATION, "thick",
                    lambda start, depth: (rows(start, depth), state(depth)), ids=ids)
        assert w is not None
        slots.append(w.slot)
    s.release_request("r1", ok=True)
    assert s.confirm(slots)[0] == slots
    assert s.disk is not None
    s.disk.drain()
    return keys


def plan(keys: dict[int, bytes], depths: list[int]) -> AnchorPlan:
    return AnchorPlan(NS, restore=tuple(AnchorRef(keys[d], d) for d in depths))


def test_a_restarted_store_restores_a_chain_from_disk_as_from_host(tmp_path):
    keys = write_chain(store(tmp_path), PROMPT, [20, 45])
    fresh = store(tmp_path)  # a new process: empty table, indexed directory
    assert fresh.table.entries() == []
    listing = fresh.slots("e2")
    assert listing.slots == () and {(d.key, d.depth) for d in listing.disk} == \
        {(keys[20], 20), (keys[45], 45)}
    check = fresh.check_chain(PROMPT, plan(keys, [20, 45]))
    assert [(s.key, s.depth, s.start) for s in check.chain] == \
        [(keys[20], 20, 0), (keys[45], 45, 20)]
    assert check.misses == ()
    assert torch.equal(check.chain[1].kv.view(torch.int16), rows(20, 45).view(torch.int16))
    assert torch.equal(check.chain[1].state, state(45))
    assert list(check.chain[1].tokens) == list(PROMPT[20:45])
    # now host slabs: listed with a slot, no longer as disk-only
    assert {(e.key, e.state) for e in fresh.slots("e2").slots} == \
        {(keys[20], "committed"), (keys[45], "committed")}
    assert fresh.slots("e2").disk == ()
    st = fresh.stats("e2")
    assert st.disk is not None and st.disk.loads == 2 and st.disk.skips == 0


@pytest.mark.parametrize("ahead", [False, True], ids=["read_here", "read_ahead"])
def test_a_chain_named_by_its_leaf_is_completed_from_disk(tmp_path, ahead):
    """The proxy names a chain's leaf only: the store finds its ancestors by their parent
    links, in memory or on disk, and also when the leaf is in memory and its parent only on
    disk. `read_ahead`: SGLang's way (`disk_reads` on the copy thread, then `check_chain`),
    where a link not read ahead is not read at all."""
    keys = write_chain(store(tmp_path), PROMPT, [10, 20, 45])
    for warm_leaf in (False, True):
        fresh = store(tmp_path)
        if warm_leaf:  # the leaf in memory, its ancestors still on disk
            assert fresh._promote(keys[45], 45, PROMPT) is not None
        leaf = plan(keys, [45])
        read = fresh.read_links(fresh.disk_reads(PROMPT, leaf)) if ahead else None
        if ahead:
            assert set(read) == {(keys[10], 10), (keys[20], 20)} | (
                set() if warm_leaf else {(keys[45], 45)})
        check = fresh.check_chain(PROMPT, leaf, read)
        assert [(s.key, s.depth, s.start) for s in check.chain] == \
            [(keys[10], 10, 0), (keys[20], 20, 10), (keys[45], 45, 20)]
        assert [h.depth for h in check.report().restored] == [45] and check.misses == ()
        assert torch.equal(check.chain[1].kv.view(torch.int16), rows(10, 20).view(torch.int16))


def test_a_leaf_whose_parent_file_is_corrupt_restores_nothing_and_names_the_parent(tmp_path):
    keys = write_chain(store(tmp_path), PROMPT, [20, 45])
    corrupt_flip(tmp_path / f"{FP[:16]}-tp0of1" / f"{keys[20].hex()}-20.slab")
    fresh = store(tmp_path)
    check = fresh.check_chain(PROMPT, plan(keys, [45]))
    assert check.chain == ()
    assert [(m["key"], m["depth"], m["reason"]) for m in check.misses] == \
        [(keys[20].hex(), 20, "not_resident")]


def test_the_late_lookup_finds_a_chain_on_disk_that_no_plan_names(tmp_path):
    keys = write_chain(store(tmp_path), PROMPT, [20, 45])
    fresh = store(tmp_path)
    # a proxy that knows nothing of this worker's files asks only for other cuts
    late = AnchorPlan(NS, snapshot=(SnapshotSpec(50, AnchorKind.CONVERSATION, Region.THICK),))
    check = fresh.check_chain(PROMPT, late)
    assert check.late_lookup and check.depth == 45
    assert {(h.key, h.depth) for h in check.held} == {(keys[20], 20), (keys[45], 45)}
    # a prompt as deep as the anchor: its last token must be prefilled, so only the root
    assert [s.depth for s in store(tmp_path).check_chain(PROMPT[:45], AnchorPlan(NS)).chain] \
        == [20]


def test_a_disk_slab_never_answers_for_another_prompt_namespace_or_depth(tmp_path):
    keys = write_chain(store(tmp_path), PROMPT, [20, 45])
    fresh = store(tmp_path)
    other = PROMPT[:30] + (7,) + PROMPT[31:]  # differs inside the leaf's rows
    check = fresh.check_chain(other, plan(keys, [20, 45]))
    assert [s.depth for s in check.chain] == [20]
    assert [m["reason"] for m in check.misses] == ["key_mismatch"]
    late = fresh.check_chain(other, AnchorPlan(NS, snapshot=(
        SnapshotSpec(45, AnchorKind.CONVERSATION, Region.THICK),)))
    assert [s.depth for s in late.chain] == [20]  # the leaf's key is not this prompt's
    # another namespace keys differently: nothing on disk answers
    assert fresh.check_chain(PROMPT, AnchorPlan(bytes(16), snapshot=(
        SnapshotSpec(45, AnchorKind.CONVERSATION, Region.THICK),))).chain == ()
    # the right key at another depth is no hit
    wrong = fresh.check_chain(PROMPT, AnchorPlan(NS, restore=(AnchorRef(keys[20], 21),)))
    assert [m["reason"] for m in wrong.misses] == ["key_mismatch"]
    # what is restored instead is the late lookup's chain, every link keyed over this prompt
    assert wrong.late_lookup
    assert all(s.key == anchor_keys(NS, MODEL, PROMPT, [s.depth])[s.depth] for s in wrong.chain)


def test_a_corrupt_leaf_on_disk_ends_the_chain_at_its_parent(tmp_path):
    keys = write_chain(store(tmp_path), PROMPT, [20, 45])
    corrupt_flip(tmp_path / f"{FP[:16]}-tp0of1" / f"{keys[45].hex()}-45.slab")
    fresh = store(tmp_path)
    check = fresh.check_chain(PROMPT, plan(keys, [20, 45]))
    assert [s.depth for s in check.chain] == [20]
    assert [m["reason"] for m in check.misses] == ["not_resident"]
    st = fresh.stats("e")
    assert st.disk is not None and st.disk.skips == 1


def test_a_worker_of_another_layout_or_model_restores_nothing(tmp_path):
    keys = write_chain(store(tmp_path), PROMPT, [20, 45])
    # same fingerprint (a lie) but slabs of another size: refused by the store's size check
    liar = store(tmp_path, kv_bytes_per_token=KV_BYTES_PER_TOKEN * 2)
    assert liar.check_chain(PROMPT, plan(keys, [20, 45])).chain == ()
    st = liar.stats("e")
    assert st.disk is not None and st.disk.skips == 2 and st.disk.files == 0  # both refused
    # another fingerprint: another directory, nothing indexed
    other = store(tmp_path, fp="ef" * 16)
    assert other.slots("e").disk == ()
    assert other.check_chain(PROMPT, plan(keys, [20, 45])).chain == ()


def test_evict_and_flush_delete_the_files_and_pins_survive_memory_eviction(tmp_path):
    s = store(tmp_path)
    keys = write_chain(s, PROMPT, [20, 45])
    assert s.pin(keys[45])
    assert s.disk is not None and s.disk.pinned(keys[45])
    assert s.evict(keys[20]) and not s.disk.has(keys[20], 20)
    assert s.flush() >= 1
    assert s.disk.entries() == [] and not list(s.disk.dir.glob("*.slab"))


def test_pin_loads_an_anchor_from_disk_first(tmp_path):
    keys = write_chain(store(tmp_path), PROMPT, [20, 45])
    fresh = store(tmp_path)
    assert fresh.pin(keys[45])
    assert {(e.key, e.pinned) for e in fresh.table.entries()} >= {(keys[45], True)}
    assert {e.key for e in fresh.table.entries()} == {keys[20], keys[45]}  # its chain too


def test_no_file_ever_holds_a_name_of_a_temporary(tmp_path):
    s = store(tmp_path)
    write_chain(s, PROMPT, [20, 45])
    assert s.disk is not None
    names = os.listdir(s.disk.dir)
    assert all(n.endswith(".slab") for n in names) and len(names) == 2


# ---- a directory shared by workers of one model ------------------------------------------------

def test_a_slab_another_worker_writes_later_is_imported_on_a_miss(tmp_path):
    b = store(tmp_path)  # started (and indexed) before the other worker wrote anything
    keys = write_chain(store(tmp_path), PROMPT, [20, 45])
    assert b.slots("e").disk == ()  # not indexed: found only when a request names it
    check = b.check_chain(PROMPT, plan(keys, [20, 45]))
    assert [(s.key, s.depth) for s in check.chain] == [(keys[20], 20), (keys[45], 45)]
    assert torch.equal(check.chain[1].kv.view(torch.int16), rows(20, 45).view(torch.int16))
    st = b.stats("e")
    assert st.disk is not None and (st.disk.imports, st.disk.loads, st.disk.skips) == (2, 2, 0)
    # the late lookup imports too: a plan that names no anchor, only the cut
    late_reader = store(tmp_path / "late")
    write_chain(store(tmp_path / "late"), PROMPT, [20, 45])
    late = late_reader.check_chain(PROMPT, AnchorPlan(NS, snapshot=(
        SnapshotSpec(45, AnchorKind.CONVERSATION, Region.THICK),)))
    assert late.late_lookup and [s.depth for s in late.chain] == [20, 45]
    assert {(h.key, h.depth) for h in late.held} == {(keys[20], 20), (keys[45], 45)}


def test_a_missing_file_costs_a_miss_and_nothing_else(tmp_path):
    s = store(tmp_path)
    assert s.disk is not None and not s.disk.has(key(9), 12)
    assert s.check_chain(PROMPT, plan(anchor_keys(NS, MODEL, PROMPT, [20]), [20])).chain == ()
    st = s.disk.stats()
    assert (st.imports, st.skips, st.files) == (0, 0, 0)


def test_a_file_copied_in_under_another_anchors_name_never_restores(tmp_path):
    """The worst bug: a slab restored for a prefix it is not. Another tenant's file (same
    tokens, another namespace), copied into the shared directory under this tenant's key's
    name, is refused when the miss finds it; nothing is restored, the file is quarantined."""
    other_ns = bytes(range(16, 32))
    writer = store(tmp_path)
    theirs = anchor_keys(other_ns, MODEL, PROMPT, [45])[45]
    w = writer.write("r", theirs, 45, AnchorKind.CONVERSATION, "thick",
                     lambda start, depth: (rows(start, depth, seed=3), state(3)), ids=PROMPT)
    assert w is not None
    writer.release_request("r", ok=True)
    writer.confirm([w.slot])
    assert writer.disk is not None
    writer.disk.drain()
    reader = store(tmp_path / "reader")
    reader.disk = DiskTier(tmp_path, FP, budget_bytes=1 << 30)  # shares the directory, not indexed
    mine = anchor_keys(NS, MODEL, PROMPT, [45])[45]
    shutil.copy(reader.disk.dir / f"{theirs.hex()}-45.slab", reader.disk.dir / f"{mine.hex()}-45.slab")
    check = reader.check_chain(PROMPT, AnchorPlan(NS, restore=(AnchorRef(mine, 45),), snapshot=(
        SnapshotSpec(45, AnchorKind.CONVERSATION, Region.THICK),)))
    assert check.chain == () and [m["reason"] for m in check.misses] == ["not_resident"]
    assert reader.disk.stats().skips == 1 and reader.disk.stats().imports == 0
    assert not (reader.disk.dir / f"{mine.hex()}-45.slab").exists()
    # the other tenant's own file still answers for its own key only
    assert reader.check_chain(PROMPT, AnchorPlan(other_ns, restore=(AnchorRef(theirs, 45),))
                              ).depth == 45


def test_a_file_whose_header_names_this_prefix_but_holds_another_prompts_tokens_is_refused(
        tmp_path):
    """A slab whose header was written for this key and depth (name, key, checksum all agree)
    but whose rows are another prompt's: the tokens it carries are checked against the prompt
    before it is promoted, so it is quarantined, never restored."""
    s = store(tmp_path)
    k = anchor_keys(NS, MODEL, PROMPT, [20])[20]
    other = tuple(range(500, 520))
    assert s.disk is not None
    s.disk.put(SlabRecord(k, 20, 0, None, "conversation", rows(0, 20, seed=7), state(7),
                          KV_BYTES_PER_TOKEN * 20 + STATE_BYTES,
                          torch.tensor(other, dtype=torch.int64)))
    s.disk.drain()
    fresh = store(tmp_path)
    for p in (plan({20: k}, [20]), AnchorPlan(NS, snapshot=(
            SnapshotSpec(20, AnchorKind.CONVERSATION, Region.THICK),))):
        assert fresh.check_chain(PROMPT, p).chain == ()
    assert fresh.disk is not None and fresh.disk.stats().skips == 1
    assert fresh.table.entries() == []


# ---- files moved between workers (`/anchor/export` → `/anchor/import`) ---------------------

def test_an_exported_chain_imported_by_a_worker_without_shared_storage_restores_as_its_own(
        tmp_path):
    keys = write_chain(store(tmp_path / "a"), PROMPT, [20, 45])
    source = store(tmp_path / "a")
    b = store(tmp_path / "b")
    assert source.disk is not None and b.disk is not None
    for d in (20, 45):  # parents first, as `ops` copies them
        entry, imported = b.disk.import_file(source.disk.export_file(keys[d]))
        assert imported and (entry.key, entry.depth) == (keys[d], d)
    assert b.disk.import_file(source.disk.export_file(keys[45]))[1] is False  # held already
    assert {(d.key, d.depth) for d in b.slots("e").disk} == {(keys[20], 20), (keys[45], 45)}
    check = b.check_chain(PROMPT, plan(keys, [20, 45]))
    assert [(s.key, s.depth, s.start) for s in check.chain] == \
        [(keys[20], 20, 0), (keys[45], 45, 20)]
    assert torch.equal(check.chain[1].kv.view(torch.int16), rows(20, 45).view(torch.int16))
    st = b.disk.stats()
    assert (st.imports, st.loads, st.skips) == (2, 2, 0)
    assert [p.name for p in b.disk.dir.iterdir() if p.name.endswith(disk_tier.TMP_SUFFIX)] == []
    # and it survives a restart of the importer like a file it wrote itself
    assert store(tmp_path / "b").check_chain(PROMPT, plan(keys, [20, 45])).depth == 45


@pytest.mark.parametrize("damage", ["flipped", "truncated", "other_fingerprint", "other_tp",
                                    "not_a_slab", "another_depth_for_a_held_key"])
def test_an_import_that_fails_a_check_is_refused_and_nothing_of_it_is_kept(tmp_path, damage):
    src = tier(tmp_path / "src")
    src.put(record(key(1), 0, 12))
    src.drain()
    path = files(src)[0]
    dst = tier(tmp_path / "dst")
    if damage == "flipped":
        corrupt_flip(path)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-7])
    elif damage == "other_fingerprint":
        other = tier(tmp_path / "other", fp="cd" * 16)
        other.put(record(key(1), 0, 12))
        other.drain()
        path = files(other)[0]
    elif damage == "other_tp":
        rewrite_meta(path, tp_rank="1", tp_size="2")
    elif damage == "not_a_slab":
        path.write_bytes(b"\x00" * 64)
    elif damage == "another_depth_for_a_held_key":
        dst.put(record(key(1), 0, 8))
        dst.drain()
    before = sorted(p.name for p in dst.dir.iterdir())
    with pytest.raises(disk_tier.CorruptSlab):
        dst.import_file(path.read_bytes())
    assert sorted(p.name for p in dst.dir.iterdir()) == before  # no file, no temporary
    assert dst.stats().skips == 1 and dst.stats().imports == 0
    assert dst.load(key(1), 12) is None


def test_export_names_only_files_the_tier_holds_and_an_off_tier_refuses_both(tmp_path):
    t = tier(tmp_path)
    t.put(record(key(1), 0, 12))
    t.drain()
    assert t.export_file(key(1)) == files(t)[0].read_bytes()
    with pytest.raises(KeyError):
        t.export_file(key(2))
    t.enabled = False
    with pytest.raises(disk_tier.DiskTierOff):
        t.export_file(key(1))
    with pytest.raises(disk_tier.DiskTierOff):
        t.import_file(files(t)[0].read_bytes())
