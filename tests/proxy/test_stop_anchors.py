"""A turn ended by a client stop string keeps its anchors: the proxy stops the worker request
(`/stop_request`) instead of aborting it, so what the prefill wrote and the response anchor
up to the stop are confirmed, and the next turn restores the previous prompt and the reply
(the real default model on the embedded worker)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from anchorcache.proxy.tenants import ANONYMOUS
from anchorcache.testing.inprocess import proxy_in_process
from anchorcache.testing.metrics import delta, scrape, value
from anchorcache.testing.servers import Endpoint, Server
from anchorcache.testing.turns import chat, stop_then_next_turn

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stopper(worker: Server) -> Iterator[Endpoint]:
    with proxy_in_process(worker.url) as server:  # its own ledger and metrics
        yield server


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_turn_after_a_stop_string_restores_the_previous_prompt_and_reply(
        stopper, stream, default_model_dir):
    stop_then_next_turn(stopper, default_model_dir, stream)


def test_stop_strings_in_every_choice_keep_the_prompt_anchors(stopper):
    """n = 2: both choices end on a stop string; the worker request is stopped, both samples'
    ends arrive, the prompt anchors are confirmed (no response anchor: the samples differ),
    and the same prompt again restores all of it."""
    messages = [{"role": "system", "content": f"You are assistant {uuid.uuid4().hex[:8]}."},
                {"role": "user", "content": "Describe the sea in many words."}]
    before = scrape(stopper)
    reply = chat(stopper, messages, n=2, temperature=1.0, seed=7, max_tokens=200, stop=[" "])
    assert [c["finish_reason"] for c in reply["choices"]] == ["stop", "stop"]
    assert all(" " not in c["message"]["content"] for c in reply["choices"])
    assert reply["usage"]["completion_tokens"] < 2 * 200
    d = delta(scrape(stopper), before)
    assert value(d, "anchorcache_reservations_total", tenant=ANONYMOUS, outcome="confirmed",
                 reason="stop_sequence") == 1
    assert value(d, "anchorcache_snapshots_total", tenant=ANONYMOUS, kind="response") == 0
    again = chat(stopper, messages, max_tokens=1)
    # the deepest kept cut short of the whole prompt (whose last token must be prefilled);
    # the system prompt is new, so nothing else could have been restored
    assert 0 < again["usage"]["prompt_tokens_details"]["cached_tokens"] \
        < reply["usage"]["prompt_tokens"]
