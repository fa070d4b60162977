"""Run by test_hybrid_kit.py in a subprocess with the CPU recipe's environment: SGLang's
unified radix cache test kit (FULL + MAMBA, CPU tensors) and our anchor checkpoint.
Prints one JSON object with what it measured."""

from __future__ import annotations

import json
from array import array

import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.test.kits.unified_radix_cache.config import CacheConfig
from sglang.test.kits.unified_radix_cache.fixtures import build_fixture, match_prefix

from anchorcache.ext.sglang import hybrid


def main() -> None:
    torch.manual_seed(0)
    cfg = CacheConfig(components=(ComponentType.FULL, ComponentType.MAMBA))
    tree, allocator, r2t = build_fixture(cfg, tree_core_backend="python")
    prompt = list(range(1000, 1100))  # a finished request's prompt: 100 tokens
    anchor = 60  # an anchor boundary inside it
    rows = allocator.alloc(len(prompt)).to(torch.int64)
    k, v = hybrid.kv_views(allocator)
    for t in (*k, *v):
        t[rows] = torch.randn(len(rows), *t.shape[1:]).to(t.dtype)
    states = hybrid.state_views(r2t)
    # the state the model had at the boundary, captured during prefill (a Mamba slot)
    at_anchor = r2t.mamba_allocator.alloc(1)
    for s in states:
        s[int(at_anchor[0])] = torch.randn(s.shape[1:]).to(s.dtype)
    kv_slab, state_slab = hybrid.capture(tree, rows[:anchor], int(at_anchor[0]))
    r2t.mamba_allocator.free(at_anchor)
    # SGLang's own tracking: the request ends, its state lands at the prompt end only
    end_slot = r2t.mamba_allocator.alloc(1)
    tree.insert(InsertParams(key=RadixKey(array("q", prompt)), value=rows,
                             mamba_value=end_slot.view(1)))
    before = int(match_prefix(tree, prompt[:anchor]).device_prefix_len)
    full_before = int(match_prefix(tree, prompt).device_prefix_len)
    after = hybrid.checkpoint_anchor(tree, prompt[:anchor], kv_slab, state_slab)
    m = match_prefix(tree, prompt[:anchor] + [7, 8, 9])
    full_after = int(match_prefix(tree, prompt).device_prefix_len)
    # the matched node's state and KV rows are the captured ones, byte for byte
    node_slot = tree.tree_core.get_component_device_value(m.last_device_node,
                                                          ComponentType.MAMBA)
    state_ok = bool(torch.equal(ops_state(states, int(node_slot[0])), state_slab))
    path = tree.path_device_indices(m.last_device_node)[:anchor].to(torch.int64)
    kv_ok = bool(torch.equal(hybrid.capture(tree, path, int(node_slot[0]))[0], kv_slab))
    print(json.dumps({"before": before, "after": after, "extended": int(m.device_prefix_len),
                      "full_before": full_before, "full_after": full_after,
                      "state_ok": state_ok, "kv_ok": kv_ok, "anchor": anchor}))


def ops_state(states: list[torch.Tensor], slot: int) -> torch.Tensor:
    from anchorcache.ext import ops

    return ops.snapshot_state(states, slot)


if __name__ == "__main__":
    main()
