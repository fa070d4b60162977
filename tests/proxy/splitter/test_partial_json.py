"""`close_json` on JSON text cut short, and on hostile text (it reads request bodies)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from anchorcache.proxy.splitter.partial_json import close_json
from anchorcache.testing.strategies import arguments, is_prefix


@settings(max_examples=200, deadline=None)
@given(value=arguments, ensure_ascii=st.booleans(), indent=st.sampled_from([None, 1]),
       data=st.data())
def test_every_prefix_of_an_object_reads_as_where_it_starts(value, ensure_ascii, indent, data):
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)
    cut = data.draw(st.integers(1, len(text)), label="cut")
    closed = close_json(text[:cut])
    assert isinstance(closed, dict) and is_prefix(closed, value), (text[:cut], closed)
    assert close_json(text) == value


def test_mismatched_or_trailing_text_is_no_prefix():
    assert close_json("{]") is None
    assert close_json('{"a": [1}') is None
    assert close_json('{"a": 1}]') is None
    assert close_json('{"a": 1} {') is None
    assert close_json("{not json") is None  # no JSON value starts like that
    assert close_json('{"a": 1, "k": tru, 1') is None


def test_hostile_text_is_read_once_and_refused():
    assert close_json("[x" + ",[" * 100_000) is None
    assert close_json('{"a": [' * 30_000 + "1," * 1_000) is None  # nests too deep
    assert close_json("[" * 200_000) is None
    assert close_json('{"a": 1,' * 50_000) is None
    assert close_json('{"a": "' + "x" * 1_000_000) == {"a": "x" * 1_000_000}
