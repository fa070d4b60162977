"""SGLang's prefill adder, with two things it must know about our anchors
(`Scheduler.get_prefill_adder_class`, wrapped by our plugin when the anchorcache radix cache
is in use):

- A request with a restore is asked about first (`tree_cache.admit_restore`, ext/sglang/
  cache.py): its restore starts here, where the round's memory budget is known (the fresh
  slots it takes count against it; a restore that does not fit is a request that does
  not fit), and while its copy is in flight the request is passed over: SGLang's loop
  goes on with the requests behind it and with the running batch, and a later round
  admits it once its rows have landed. This is the pattern of SGLang's HiCache prefetch
  (`check_prefetch_progress`), which 0.5.23 runs only for its own storage tiers.
- On a hybrid model whose kernels cannot capture a state inside the forward
  (ext/sglang/capture.py), a prefill chunk ends at each planned anchor depth
  (`tree_cache.next_cut`, ext/sglang/hybrid.py): a request whose next depth lies inside
  this round's extend is admitted as a chunked request whose chunk ends there, and a
  chunked request's next chunk stops there too. SGLang tracks one chunked request at a
  time, so a cut is made only when no other request is chunked; otherwise the request
  waits a round.

A request passed over is cleaned up as SGLang cleans up one it did not admit, and the
requests queued behind it are considered as usual (SGLang's own rejection would end the
round's admission there).
"""

from __future__ import annotations

from typing import Any


def prefill_adder_class(base: type) -> type:
    """SGLang's prefill adder `base`, plus the two rules of the module docstring."""
    from sglang.srt.managers.schedule_policy import AddReqResult, _PrefillAdmission

    class AnchorPrefillAdder(base):  # type: ignore[misc,valid-type]
        _waits: Any = None  # the request refused this round because its cut must wait

        def __init__(self, page_size: int, tree_cache: Any, *args: Any, **kwargs: Any) -> None:
            # before SGLang reads the round's budget: restores whose copy is done go into the
            # tree now, reached this round or not (their rows then count as evictable)
            tree_cache.land_ready()
            super().__init__(page_size, tree_cache, *args, **kwargs)

        def _select_prefill_admission(self, req: Any, **kwargs: Any) -> Any:
            got = super()._select_prefill_admission(req, **kwargs)
            if isinstance(got, AddReqResult) or self.rem_chunk_tokens is None:
                return got
            cut = self.tree_cache.next_cut(req, got.prefix_len)
            ours = cut is not None and cut < got.prefix_len + got.extend_len
            if ours:
                got = _PrefillAdmission(got.prefix_len, cut - got.prefix_len, 0, True,
                                        got.replay_len)
            if got.is_chunked and (kwargs.get("has_chunked_req")
                                   or self.new_chunked_req is not None):
                if ours:
                    self._waits = req
                return AddReqResult.OTHER  # one chunked request at a time
            return got

        def add_one_req(self, req: Any, has_chunked_req: bool,
                        truncation_align_size: Any) -> Any:
            restore = self.tree_cache.admit_restore(req, lambda: self.rem_total_tokens)
            if restore == "wait":
                return self._pass_over(req)
            if restore == "no_room":
                return AddReqResult.NO_TOKEN  # as a request that does not fit (the
                # scheduler cleans it up and ends the round's admission)
            result = super().add_one_req(req, has_chunked_req, truncation_align_size)
            if self._waits is not req:
                return result
            self._waits = None
            verdict = self.budget_state()
            if verdict != AddReqResult.CONTINUE:
                return verdict  # the scheduler rejects it as its own (and cleans up)
            return self._pass_over(req)

        def _pass_over(self, req: Any) -> Any:
            """What the scheduler does for a request it did not add: drop the Mamba slot
            and copy-on-write its admission match staged (the next round matches it again)."""
            req.kv.mamba_cow_src_index = None
            req.kv.mamba_needs_clear = False
            if req.kv.holds_mamba and not getattr(req, "session", None):
                self.tree_cache.req_to_token_pool.mamba_allocator.free(
                    req.kv.mamba_pool_idx.unsqueeze(-1))
                req.kv.mamba_pool_idx = None
            return AddReqResult.CONTINUE

        def add_chunked_req(self, req: Any) -> Any:
            cut = self.tree_cache.next_cut(req, req.prefix_len)
            if cut is not None and self.rem_chunk_tokens is not None:
                limit: int = cut - req.prefix_len
                given: int | None = getattr(self, "chunked_req_limit", None)
                self.chunked_req_limit = limit if given is None else min(limit, given)
            return super().add_chunked_req(req)

    return AnchorPrefillAdder
