"""The lease table (`proxy/leases.py`) on its own: expiry and refresh on an injected clock,
the budget counting every protected byte once, epochs. Pure: milliseconds, no worker."""

from __future__ import annotations

import math

from anchorcache.proxy.leases import LeaseTable

A, B, C, D = (bytes([i]) * 16 for i in range(1, 5))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_expires_after_its_ttl_and_each_use_pushes_it_out():
    clock = Clock()
    table = LeaseTable(clock)
    table.grant(A, "t", "e1", {A: 10}, 300.0)
    clock.now += 299
    assert table.due() == []
    assert table.refresh([A, B], "t") == 1  # a restore of A (B is no lease)
    clock.now += 299
    assert table.due() == []  # 598 s after the grant, 299 after the use
    clock.now += 1
    assert [lease.key for lease in table.due()] == [A]
    assert table.get(A) is not None  # due, still held until dropped (unpinned)


def test_a_lease_never_shortens_and_keeps_its_longest_ttl():
    clock = Clock()
    table = LeaseTable(clock)
    table.grant(A, "t", "e1", {A: 10}, 3600.0)
    table.grant(A, "t", "e1", {}, 300.0)  # a 5m mark on an anchor leased for an hour
    lease = table.get(A)
    assert lease is not None and lease.ttl_s == 3600.0 and lease.expires_at == 1000 + 3600
    assert lease.chain == {A: 10}
    clock.now += 3000
    table.refresh([A], "t")
    assert table.get(A).expires_at == 4000 + 3600  # type: ignore[union-attr]


def test_only_the_owner_refreshes_a_lease():
    clock = Clock()
    table = LeaseTable(clock)
    table.grant(A, "t", "e1", {A: 10}, 300.0)
    clock.now += 200
    assert table.refresh([A], "someone-else") == 0
    assert table.get(A).expires_at == 1300  # type: ignore[union-attr]


def test_the_budget_counts_shared_ancestors_once_per_tenant_and_in_all():
    table = LeaseTable(Clock())
    table.grant(B, "t", "e1", {A: 100, B: 50}, 300.0)  # B's chain: A → B
    # C chains on A too: only C's own bytes are new
    assert table.protected_bytes("t", {A: 100, C: 30}) == 180
    assert table.fits("t", {A: 100, C: 30}, tenant_limit=180, budget=180)
    assert not table.fits("t", {A: 100, C: 30}, tenant_limit=179, budget=10**9)
    # another tenant's chain counts in the budget, never in this tenant's limit
    table.grant(D, "u", "e1", {D: 500}, 300.0)
    assert table.protected_bytes("t") == 150 and table.protected_bytes() == 650
    assert table.fits("t", {C: 30}, tenant_limit=180, budget=680)
    assert not table.fits("t", {C: 30}, tenant_limit=180, budget=679)


def test_due_everything_drop_put_back_and_epochs():
    clock = Clock()
    table = LeaseTable(clock)
    table.grant(A, "t", "e1", {A: 1}, 300.0)
    table.grant(B, "t", "e2", {B: 1}, 3600.0)
    assert [lease.key for lease in table.due(math.inf)] == [A, B]  # soonest first
    lease = table.drop(A)
    assert lease is not None and table.get(A) is None
    table.put_back(lease)  # its unpin failed
    assert table.get(A) is lease
    assert [lease.key for lease in table.keep_epoch("e2")] == [A]
    assert table.keys() == {B} and len(table) == 1
