"""The embedded engine's structured decoding, in process on the default model (SmolLM2):
grammar masks (json_schema, regex, structural tags), n samples from one prefill, logprobs.

The engine runs in this process so a forward hook can count the tokens the model is fed:
n samples must cost one prompt prefill plus their own decode steps, nothing more.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from anchorcache.wire import GenerateRequest, SamplingParams, WireError

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "days": {"type": "integer", "minimum": 1}},
          "required": ["city", "days"], "additionalProperties": False}


class Loaded:
    def __init__(self, engine: Any, tokenizer: Any) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.fed = 0  # tokens fed to the model by forwards since the last reset

    def prompt(self, text: str) -> tuple[int, ...]:
        msgs = [{"role": "user", "content": text}]
        return tuple(self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False))

    async def run(self, ids: tuple[int, ...], params: SamplingParams, *,
                  logprobs: bool = False, top: int = 0) -> list[dict[str, Any]]:
        """Every sample's {ids, picks, finish, meta}, in index order."""
        req = GenerateRequest(input_ids=ids, sampling=params, return_logprob=logprobs,
                              top_logprobs_num=top)
        grammar = None
        if params.constraint is not None:
            grammar = self.engine.grammars.compile(*params.constraint)
        job = self.engine.submit(req, grammar=grammar)
        samples: list[dict[str, Any]] = [{"ids": [], "picks": []} for _ in range(params.n)]
        from anchorcache.ext.embedded.engine import ErrorEvent, FinishEvent, TokenEvent

        while True:
            event = await job.events.get()
            if isinstance(event, ErrorEvent):
                raise event.error
            if isinstance(event, TokenEvent):
                samples[event.index]["ids"].extend(event.output_ids)
                samples[event.index]["picks"].extend(event.picks or ())
            elif isinstance(event, FinishEvent):
                samples[event.index].update(finish=event.finish_reason, meta=event.meta.to_json())
                if event.last:
                    return samples

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def loaded(smollm2_path) -> Iterator[Loaded]:
    from anchorcache.ext.embedded.app import WorkerConfig, load_engine

    engine, _ = load_engine(WorkerConfig(model=str(smollm2_path), threads=2, anchors=False))
    from transformers import AutoTokenizer

    out = Loaded(engine, AutoTokenizer.from_pretrained(smollm2_path))

    def count(_module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        out.fed += int(ids.shape[-1])

    hook = engine.model.register_forward_pre_hook(count, with_kwargs=True)
    engine.start()
    yield out
    engine.stop()
    hook.remove()


async def test_json_schema_output_validates(loaded: Loaded) -> None:
    ids = loaded.prompt("Plan a trip: answer with a city and a number of days.")
    params = SamplingParams(max_new_tokens=60, temperature=0.0, json_schema=json.dumps(SCHEMA),
                            stop_token_ids=(2,))
    [sample] = await loaded.run(ids, params)
    assert sample["finish"]["type"] == "stop"  # the grammar ended it, with a stop token
    jsonschema.validate(json.loads(loaded.text(sample["ids"])), SCHEMA)


async def test_regex_output_matches(loaded: Loaded) -> None:
    ids = loaded.prompt("What is the date of the French national day?")
    pattern = r"(January|July) [1-9][0-9]?, [0-9]{4}"
    params = SamplingParams(max_new_tokens=20, temperature=0.0, regex=pattern, stop_token_ids=(2,))
    [sample] = await loaded.run(ids, params)
    assert re.fullmatch(pattern, loaded.text(sample["ids"]))


def test_bad_grammars_are_wire_errors(loaded: Loaded) -> None:
    grammars = loaded.engine.grammars
    for kind, text in [("json_schema", '{"type": "objec"}'), ("json_schema", "{not json"),
                       ("regex", "(a"), ("ebnf", 'root ::= "a" |'),
                       ("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}')]:
        with pytest.raises(WireError, match=f"invalid {kind}"):
            grammars.compile(kind, text)


async def test_n_samples_share_one_prefill_and_are_reproducible(loaded: Loaded) -> None:
    ids = loaded.prompt("Write one sentence about the sea.")
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234, n=4)
    loaded.fed = 0
    first = await loaded.run(ids, params)
    # one prompt prefill; each sample feeds back all its tokens but the last
    assert loaded.fed == len(ids) + sum(len(s["ids"]) - 1 for s in first)
    assert [s["meta"]["index"] for s in first] == [0, 1, 2, 3]
    assert all(s["meta"]["prefill_tokens"] == len(ids) for s in first)
    assert len({tuple(s["ids"]) for s in first}) > 1  # seed + i: the samples differ
    again = await loaded.run(ids, params)
    assert [s["ids"] for s in again] == [s["ids"] for s in first]
    [alone] = await loaded.run(ids, SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234))
    assert alone["ids"] == first[0]["ids"]


async def test_greedy_samples_equal_the_single_greedy_output(loaded: Loaded) -> None:
    """Each sample decodes from an exact copy of the prompt's state."""
    ids = loaded.prompt("Name three colors.")
    [single] = await loaded.run(ids, SamplingParams(max_new_tokens=10, temperature=0.0))
    many = await loaded.run(ids, SamplingParams(max_new_tokens=10, temperature=0.0, n=3))
    assert [s["ids"] for s in many] == [single["ids"]] * 3


async def test_logprobs_describe_the_chosen_tokens(loaded: Loaded) -> None:
    ids = loaded.prompt("Say hello.")
    [sample] = await loaded.run(ids, SamplingParams(max_new_tokens=6, temperature=0.0),
                                logprobs=True, top=3)
    picks = sample["picks"]
    assert [p.token for p in picks] == sample["ids"]
    for p in picks:
        assert len(p.top) == 3 and p.top[0][0] == p.token  # greedy: the most likely
        assert p.logprob == pytest.approx(p.top[0][1]) and p.logprob <= 0.0
        assert [lp for _, lp in p.top] == sorted((lp for _, lp in p.top), reverse=True)


# ---- the same over the worker contract (HTTP), on the shared default worker -------------

def _post(worker: Any, body: dict[str, Any]) -> Any:
    import httpx

    return httpx.post(worker.url + "/generate", json=body, timeout=120)


def test_bad_constraints_are_400_over_http(worker: Any) -> None:
    ids = [1, 9690, 198, 2]
    for sampling in [{"json_schema": '{"type": "objec"}'}, {"regex": "(a"},
                     {"ebnf": "root ::="}, {"regex": "a", "ebnf": 'root ::= "a"'},
                     {"json_schema": {"type": "object"}}, {"n": 0}, {"n": 17}]:
        resp = _post(worker, {"input_ids": ids, "sampling_params": sampling})
        assert resp.status_code == 400, (sampling, resp.text)
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]


def test_n_samples_and_logprobs_over_http(worker: Any) -> None:
    import httpx

    body = {"input_ids": [1, 9690, 198, 33, 2], "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.8, "seed": 7, "n": 2,
                                "ignore_eos": True},
            "stream": True}
    tokens: dict[int, list[int]] = {0: [], 1: []}
    finals = []
    with httpx.stream("POST", worker.url + "/generate", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        event = json.loads(line)
        if "meta_info" in event:
            finals.append(event)
            continue
        tokens[event["index"]] += event["output_ids"]
        [[logprob, token, _]] = event["output_token_logprobs"]
        assert token == event["output_ids"][0] and logprob <= 0
        assert len(event["output_top_logprobs"][0]) == 2
    assert [f["index"] for f in finals] == [0, 1]
    assert all(len(t) == 4 for t in tokens.values())
    whole = _post(worker, {**body, "stream": False}).json()
    assert [r["output_ids"] for r in whole] == [tokens[0], tokens[1]]  # seeded: the same
    assert [r["meta_info"]["completion_tokens"] for r in whole] == [4, 4]
