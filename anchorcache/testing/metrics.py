"""A proxy's `/metrics`, parsed with prometheus-client's parser, and the arithmetic the
tests do on it (a counter's value, its change between two scrapes)."""

from __future__ import annotations

from typing import Any

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The series of `name` with exactly `labels` (0 if absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum over every series of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def scrape(proxy: Any) -> Samples:
    """`proxy`'s (an `Endpoint`) `/metrics` now."""
    import httpx

    resp = httpx.get(proxy.url + "/metrics", timeout=30)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    return parse(resp.text)


def delta(after: Samples, before: Samples) -> Samples:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}
