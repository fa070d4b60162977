"""Restoring an anchor from the disk tier vs from a host slab vs recomputing it, per token.

The embedded worker's own code paths on the default model (SmolLM2-135M, CPU): `recompute`
prefills the prefix into a fresh cache; `host` builds a cache from the anchor's host slab
(`cache_from_slabs`); `disk` loads its slab file (header, layout and checksum checked,
`DiskTier.load`) and then does what `host` does. The file was just written, so it is in the
page cache: `disk` is the warm-file cost, a cold disk adds its read time. Prints a table and
writes bench/results/disk_tier.json.

    python bench/disk_tier.py [--tokens 256,1024,2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from anchorcache.ext.disk_tier import DiskTier, SlabRecord, model_fingerprint
from anchorcache.ext.embedded import cache_io
from anchorcache.ext.embedded.anchors import Slab, cache_from_slabs, capture_slabs
from anchorcache.ext.embedded.model_store import prepare_default_model
from anchorcache.wire import AnchorKind

OUT = Path(__file__).parent / "results" / "disk_tier.json"


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,1024,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    path = prepare_default_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    spec = cache_io.CacheSpec.from_model(model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        disk = DiskTier(tmp, model_fingerprint(path, "float32"), budget_bytes=1 << 40)
        for n in (int(t) for t in args.tokens.split(",")):
            ids = torch.randint(0, 10000, (n + 1,), generator=torch.Generator().manual_seed(n))

            def recompute(ids: torch.Tensor = ids, n: int = n) -> object:
                cache = cache_io.new_cache(model)
                return cache_io.prefill(model, cache, ids[: n + 1], 0, [n])

            cache = cache_io.new_cache(model)
            cache_io.prefill(model, cache, ids[:n], 0)
            kv, state = capture_slabs(spec, cache, 0, n)
            key = n.to_bytes(16, "little")
            nbytes = spec.kv_bytes_per_token * n + spec.state_bytes
            slab = Slab(key, n, 0, None, AnchorKind.CONVERSATION, kv, state, nbytes)
            disk.put(SlabRecord(key, n, 0, None, "conversation", kv, state, nbytes))
            disk.drain()

            def host(slab: Slab = slab) -> object:
                return cache_from_slabs(model, spec, [slab])

            def from_disk(key: bytes = key, n: int = n) -> object:
                rec = disk.load(key, n)
                assert rec is not None
                return cache_from_slabs(model, spec, [Slab(
                    rec.key, rec.depth, rec.start, rec.parent, AnchorKind.CONVERSATION, rec.kv,
                    rec.state, rec.nbytes)])

            r = {"tokens": n, "slab_bytes": nbytes,
                 "recompute_ms": best_ms(recompute, args.repeats),
                 "host_ms": best_ms(host, args.repeats),
                 "disk_ms": best_ms(from_disk, args.repeats)}
            for k in ("recompute", "host", "disk"):
                r[f"{k}_us_per_token"] = r[f"{k}_ms"] * 1e3 / n
            rows.append(r)
            print(f"{n:>6} tokens {nbytes / 2**20:7.1f} MiB | recompute {r['recompute_ms']:8.1f} ms"
                  f" ({r['recompute_us_per_token']:6.1f} us/tok) | host {r['host_ms']:7.2f} ms "
                  f"({r['host_us_per_token']:5.2f} us/tok) | disk {r['disk_ms']:7.2f} ms "
                  f"({r['disk_us_per_token']:5.2f} us/tok)", flush=True)
        disk.close()
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({
        "command": "python bench/disk_tier.py " + f"--tokens {args.tokens} --repeats {args.repeats}"
                   f" --threads {args.threads}",
        "model": path.name, "device": "cpu", "dtype": "float32",
        "note": "disk: a file just written (page cache warm); median of repeats",
        "rows": rows}, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
