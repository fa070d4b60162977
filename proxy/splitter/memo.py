"""Per-scope memo of per-message work, keyed by each message's exact JSON bytes.

An agent resends every earlier message of its conversation with each turn. Validating,
normalizing and rendering them again made the proxy's CPU per request grow with the
conversation (55 ms a turn at 100k tokens, against 9 ms at 5k) rather than with the turn.
What the proxy derives from one message (its validated record, its normalized and defused
copy, its tool calls' argument text) is a pure function of the message and of the
process's fixed configuration, so it is keyed by the message's JSON bytes (`orjson.dumps`,
in C: about 1 ms for a 100k-token conversation), and a hit is exactly what the work would
give. Derived values are shared between requests: whoever gets one must not mutate it.

Scopes never mix: the scope is the caller's namespace (a tenant, narrowed by its cache
salt), as for `planner.PrefixKeys`, so no caller's request can hit, and so time, another's
messages. Bounded by bytes over all scopes (least recently used entries go first);
thread-safe, since the split threads share it. An `OrderedDict` rather than cachetools'
`LRUCache`: a lookup is on the path of every message of every request, and cachetools'
Python-level `get` cost 1.7 µs of it, the dict's C-level `get` and `move_to_end` 0.2.

Lists, too (`map`): a turn's message list usually extends, item for item, a list the scope
sent before (the last turn's). So the memo also keeps each scope's last few lists (their
JSON bytes and what was derived from them), and a list whose JSON bytes start with a kept
one's, up to an item boundary, takes that one's derived items whole: one `orjson.dumps` of
the list and a `bytes.startswith` (memcmp) instead of a lookup per message, so the cost of a
turn grows with its new messages, not with the conversation (2,400 messages at 100k tokens).
Equal bytes up to an item boundary are equal items: a JSON value's extent is fixed by its
own bytes (a number's by the comma or bracket after it, checked).

The body itself, too (`read`): decoding a 100k-token conversation's body (2,400 messages)
costs 2 ms and freeing it 1 ms more, each turn. A list kept from a body (`Read.head`: the
body's own bytes up to the end of the list's last item) that a new body's bytes start with,
up to an item boundary, spares decoding those items at all: what follows them is decoded
in place of the list, behind a random marker item (`_after`), and the marker found first
in the decoded list proves the list is the body's own (the last value of its key, as a full
decode would take it). Where the list ends in the new body comes from orjson's own parse
(content after a JSON document is an error that says where the document ends:
`_list_end`), so the next turn can be read the same way.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import orjson

from anchorcache.defaults import CONVERSATIONS_PER_SCOPE

T = TypeVar("T")
_OVERHEAD = 512  # bytes counted per entry beyond 3× its key (the key, and the values' copies)
LISTS_PER_SCOPE = CONVERSATIONS_PER_SCOPE  # lists kept per scope: its conversations in flight
_ITEM_END = frozenset(b",]")
_WS = b" \t\r\n"  # JSON's whitespace
_WS_RUN = re.compile(rb"[ \t\r\n]*")
MAX_KEPT_BYTES = 8 << 20  # bodies kept to be read from (`MessageMemo.read`): 1.6M tokens


class _List:
    """A list the scope sent: its JSON bytes without the closing bracket (`opens` -1), or
    the bytes of the body it was in up to the end of its last item (`opens`: where the
    list's bracket is in them); what was derived from each item; the bytes it is counted
    for."""

    __slots__ = ("head", "opens", "size", "values")

    def __init__(self, head: bytes, values: tuple[Any, ...], opens: int = -1) -> None:
        self.head, self.values, self.opens = head, values, opens
        self.size = 3 * len(head) + _OVERHEAD


@dataclass(frozen=True)
class Read:
    """A JSON body decoded by `MessageMemo.read`. Where `start` > 0, the body's list holds
    only its items after the first `start`, whose derived values are `prior` (a kept
    list's: shared, never mutated). `raw`: the body's bytes. `head`: them up to the end of
    the list's last item, where it was found (`opens`: where the list's bracket is), else
    None; `scope`: the scope the kept lists were looked up in."""

    body: Any
    raw: bytes = b""
    scope: bytes = b""
    start: int = 0
    prior: tuple[Any, ...] = ()
    head: bytes | None = None
    opens: int = -1


def _list_end(raw: bytes, s: int) -> tuple[int, int] | None:
    """Where the JSON array whose items (or whose closing bracket) start at `raw[s]` ends,
    with content after it: (the index after its last item, the index after its bracket),
    from orjson's own parse (`[` + the rest is a document followed by more content, an error
    that gives the document's end: a character index, turned into bytes). None if that is
    not what the bytes are, or the array is empty."""
    doc = b"[" + raw[s:]
    try:
        orjson.loads(doc)
        return None  # nothing after the array: not a member of an object
    except orjson.JSONDecodeError as e:
        if not e.msg.startswith("unexpected content after document"):
            return None
        end = len(e.doc[:e.pos].encode("utf-8", "surrogatepass"))
    array = doc[:end].rstrip(_WS)
    if not array.endswith(b"]"):
        return None
    items = len(array[:-1].rstrip(_WS))
    if items <= 1:
        return None  # `[]`: no item
    return s + items - 1, s + len(array) - 1


def _ws_end(raw: bytes, j: int) -> int:
    """The index of the first byte at or after `j` that is not JSON whitespace (in C: a
    body can hold megabytes of it)."""
    m = _WS_RUN.match(raw, j)
    return m.end() if m is not None else j


def _marked(raw: bytes, opens: int, after: bytes, key: str) -> tuple[Any, list[Any]] | None:
    """`raw[:opens]` + `["marker"` + `after` decoded, with a marker item no client can have
    sent (128 random bits, made after the body arrived): the body and its list `key` after
    the marker, where the marker leads the list the body's `key` holds (so that list is the
    one put at `opens`, not a later member of the same name); else None."""
    marker = "anchorcache-" + os.urandom(16).hex()
    try:
        body = orjson.loads(raw[:opens] + b'["' + marker.encode() + b'"' + after)
    except orjson.JSONDecodeError:
        return None
    items = body.get(key) if isinstance(body, dict) else None
    if not isinstance(items, list) or not items or items[0] != marker:
        return None
    return body, items[1:]


def _after(raw: bytes, kept: _List, key: str, scope: bytes) -> Read | None:
    """`raw`, whose bytes start with `kept.head` (a body's up to the end of its list `key`'s
    last item) at an item boundary, decoded without the kept items: what follows them is
    decoded in place of the list, behind a marker item (`_marked`). None where that is not
    the body's list `key` (a later member of the same name, content that is not JSON
    there), so the caller decodes the whole body and raises its error."""
    s = _ws_end(raw, len(kept.head))  # what follows the kept items: `,` or `]`
    more = raw[s:s + 1] == b","
    if not more and raw[s:s + 1] != b"]":
        return None
    # (a trailing comma, `[marker,]`, is orjson's error, as the whole body's)
    got = _marked(raw, kept.opens, raw[s:], key)
    if got is None:
        return None
    body = got[0]
    body[key] = got[1]
    head: bytes | None = kept.head
    if more:
        ends = _list_end(raw, s + 1)
        head = raw[:ends[0]] if ends is not None else None
    return Read(body, raw, scope, len(kept.values), kept.values, head, kept.opens)


def _located(raw: bytes, body: Any, key: str, scope: bytes) -> Read:
    """`body` (`raw` decoded whole) with where its list `key` is in `raw`, if found: the
    first place the key's name is followed by an array (where every client puts it:
    `messages`, `input` is a member before anything that could spell it), checked as
    `_after` checks (the array put in its place proves it the body's list `key`). Not
    looked for in a body over `MAX_KEPT_BYTES`: this runs on the event loop, and costs
    two more passes over the body."""
    items = body.get(key) if isinstance(body, dict) else None
    if not isinstance(items, list) or not items or len(raw) > MAX_KEPT_BYTES:
        return Read(body, raw, scope)
    name = orjson.dumps(key)
    j = raw.find(name)
    if j < 0:
        return Read(body, raw, scope)
    j = _ws_end(raw, j + len(name))
    if raw[j:j + 1] != b":":
        return Read(body, raw, scope)
    j = _ws_end(raw, j + 1)
    ends = _list_end(raw, j + 1) if raw[j:j + 1] == b"[" else None
    if ends is None:
        return Read(body, raw, scope)
    probe = _marked(raw, j, b"]" + raw[ends[1]:], key)
    if probe is None or probe[1]:
        return Read(body, raw, scope)
    return Read(body, raw, scope, head=raw[:ends[0]], opens=j)


class MessageMemo:
    def __init__(self, max_bytes: int = 32 << 20) -> None:
        self.max_bytes = max_bytes
        self._lru: OrderedDict[tuple[bytes, bytes], tuple[int, Any]] = OrderedDict()
        # scope → its last few lists, newest first (within the same byte budget)
        self._lists: OrderedDict[bytes, list[_List]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def read(self, scope: bytes, raw: bytes, key: str) -> Read:
        """The JSON body `raw` decoded (orjson's error raised as is), sparing the items of
        its list `key` that extend, at an item boundary, a list `scope` kept from a body
        read here (`map` with the `Read`): the module docstring. A `Read` for `map`."""
        with self._lock:
            kept = self._extended(scope, raw)
        if kept is not None:
            got = _after(raw, kept, key, scope)
            if got is not None:
                with self._lock:
                    self.hits += got.start
                    self._lists.move_to_end(scope)
                return got
        return _located(raw, orjson.loads(raw), key, scope)

    def keep(self, scope: bytes, read: Read, head: bytes, values: Sequence[Any]) -> None:
        """Keep the list of the body `read` up to its item whose end `head` is at (`values`:
        what was derived from its items), for later bodies `read` in `scope` (bodies read
        in another scope, a salted caller's, are not kept: looked up, they never hit)."""
        if read.scope == scope and read.opens >= 0:
            with self._lock:
                self._keep(scope, _List(head, tuple(values), read.opens))

    def _extended(self, scope: bytes, raw: bytes) -> _List | None:
        """The kept body list of `scope`'s with the most items whose head `raw` starts with,
        followed by `,` or `]` (after whitespace)."""
        best = None
        for kept in self._lists.get(scope, ()):
            if kept.opens < 0 or (best is not None and len(kept.values) <= len(best.values)):
                continue
            if raw.startswith(kept.head):
                k = _ws_end(raw, len(kept.head))
                if raw[k:k + 1] in (b",", b"]"):
                    best = kept
        return best

    def map(self, scope: bytes, items: Sequence[Any], derive: Callable[[int, Any], T], *,
            head: bytes | None = None, read: Read | None = None) -> list[T]:
        """`[derive(i, item) for i, item in enumerate(items)]`, each result taken from the
        memo where `scope` saw an item of the same JSON bytes before: the leading items a
        kept list of the scope's shares with `items` whole, the others one by one. `derive`
        depends only on the item (the index is for its error messages: an item that raises
        is not kept, so a hit was derived without error). Items that are not JSON (or nest
        past orjson's limit) are derived every time. `head`: `orjson.dumps(items)` less the
        closing bracket, where the caller made it (or bytes that stand for it: `Read.head`). `read`: the body `items` came from (`read`): `items` are then
        the items after its `start`, and the list is kept by the body's bytes (when read in
        this very scope)."""
        if read is not None:
            out = list(read.prior) + self._items(scope, items, derive, 0, read.start)
            if read.head is not None:
                self.keep(scope, read, read.head, out)
            return out
        if head is None:
            try:
                head = orjson.dumps(items)[:-1]
            except (TypeError, orjson.JSONEncodeError):
                return self._items(scope, items, derive, 0)
        with self._lock:
            kept = self._shared(scope, head, len(items))
        out = list(kept)
        if len(out) < len(items):
            out += self._items(scope, items, derive, len(out))
            with self._lock:
                self._keep(scope, _List(head, tuple(out)))
        return out

    def _shared(self, scope: bytes, head: bytes, count: int) -> tuple[Any, ...]:
        """The derived items of the longest leading run of items that one of `scope`'s kept
        lists shares with the list of `count` items whose JSON bytes (less the closing
        bracket) are `head`."""
        best: tuple[Any, ...] = ()
        lists = self._lists.get(scope)
        for kept in lists or ():
            if kept.opens >= 0 or len(kept.values) <= len(best):
                continue
            if len(kept.head) <= len(head):  # `head` extends it, or repeats it
                if head.startswith(kept.head) and (
                        len(kept.head) == len(head) or head[len(kept.head)] in _ITEM_END):
                    best = kept.values
            elif kept.head.startswith(head) and kept.head[len(head)] in _ITEM_END:
                best = kept.values[:count]  # the list is a leading part of a kept one
        if best:
            self.hits += len(best)
            self._lists.move_to_end(scope)
        return best

    def _keep(self, scope: bytes, new: _List) -> None:
        if new.size > self.max_bytes:
            return
        lists = self._lists.setdefault(scope, [])
        self._lists.move_to_end(scope)
        for old in [k for k in lists if new.head.startswith(k.head)]:  # superseded by it
            lists.remove(old)
            self._bytes -= old.size
        lists.insert(0, new)
        self._bytes += new.size
        while len(lists) > LISTS_PER_SCOPE:
            self._bytes -= lists.pop().size
        self._shrink()

    def _items(self, scope: bytes, items: Sequence[Any], derive: Callable[[int, Any], T],
               start: int, base: int = 0) -> list[T]:
        """`derive` of `items[start:]` through the per-item memo (`base`: the first item's
        index in its list)."""
        out: list[T] = []
        for i in range(start, len(items)):
            item = items[i]
            try:
                key = (scope, orjson.dumps(item))
            except (TypeError, orjson.JSONEncodeError):
                out.append(derive(base + i, item))
                continue
            with self._lock:
                entry = self._lru.get(key)
                if entry is None:
                    self.misses += 1
                else:
                    self.hits += 1
                    self._lru.move_to_end(key)
            if entry is not None:
                out.append(entry[1])
                continue
            value = derive(base + i, item)
            size = 3 * len(key[1]) + _OVERHEAD
            if size <= self.max_bytes:
                with self._lock:
                    self._put(key, size, value)
            out.append(value)
        return out

    def _put(self, key: tuple[bytes, bytes], size: int, value: Any) -> None:
        old = self._lru.pop(key, None)  # another thread derived it meanwhile
        if old is not None:
            self._bytes -= old[0]
        self._lru[key] = (size, value)
        self._bytes += size
        self._shrink()

    def _shrink(self) -> None:
        """Within `max_bytes`: the least recently used items first, then lists."""
        while self._bytes > self.max_bytes and self._lru:
            _, (dropped, _) = self._lru.popitem(last=False)
            self._bytes -= dropped
        while self._bytes > self.max_bytes and self._lists:
            scope, lists = next(iter(self._lists.items()))
            self._bytes -= lists.pop().size
            if not lists:
                del self._lists[scope]

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            self._lists.clear()
            self._bytes = 0



class Sized(Protocol):
    @property
    def size(self) -> int:  # the bytes it is counted for
        ...


E = TypeVar("E", bound=Sized)


class ScopedEntries(Generic[E]):
    """Per scope (a caller's namespace), its last `per_scope` entries, newest first, and
    `max_bytes` of entries over all scopes (the least recently used scope gives up its
    oldest first): the bookkeeping of the memos that keep a state per conversation in
    flight (`PrefixStates`, responses_items.MessagesMemo). Not locked: its owner locks where
    threads share it."""

    def __init__(self, max_bytes: int, per_scope: int) -> None:
        self.max_bytes, self.per_scope = max_bytes, per_scope
        self._scopes: OrderedDict[bytes, list[E]] = OrderedDict()
        self.size_bytes = 0

    def of(self, scope: bytes) -> Sequence[E]:
        """`scope`'s entries, newest first (read, not changed)."""
        return self._scopes.get(scope, ())

    def touch(self, scope: bytes) -> None:
        """`scope` was used: the last to give up its entries."""
        if scope in self._scopes:
            self._scopes.move_to_end(scope)

    def put(self, scope: bytes, new: E, replaced: Sequence[E] = ()) -> None:
        """Keep `new` as `scope`'s newest entry (unless alone over `max_bytes`), in place of
        those of `replaced` (by identity) still kept."""
        entries = self._scopes.setdefault(scope, [])
        self._scopes.move_to_end(scope)
        for old in replaced:
            if any(e is old for e in entries):
                entries.remove(old)
                self.size_bytes -= old.size
        if new.size > self.max_bytes:
            return
        entries.insert(0, new)
        self.size_bytes += new.size
        while len(entries) > self.per_scope:
            self.size_bytes -= entries.pop().size
        while self.size_bytes > self.max_bytes:
            oldest, kept = next(iter(self._scopes.items()))
            self.size_bytes -= kept.pop().size
            if not kept:
                del self._scopes[oldest]

    def clear(self) -> None:
        self._scopes.clear()
        self.size_bytes = 0


class _State:
    __slots__ = ("context", "count", "head", "size", "state")

    def __init__(self, context: bytes, head: bytes, count: int, state: Any,
                 size: int | None) -> None:
        self.context, self.head, self.count, self.state = context, head, count, state
        self.size = 3 * (len(head) + len(context)) + _OVERHEAD if size is None else size


class PrefixStates:
    """Per scope, the state of a pass over a JSON list after a leading part of it (the last
    turn's split, splitter/turns.py; a conversion that carries pending tool calls from
    message to message, anthropic_schema.py), so that a later list that extends it, item
    for item, resumes the pass there: the list memo's rule (`MessageMemo.map`) for work that
    is not a function of each item alone.

    A state is found for `(scope, context, head)` when one of the scope's last few kept
    states has the same `context` (the bytes of whatever else the pass read: tools, system,
    template arguments) and its `head` (the list's JSON bytes up to the end of its `count`
    items) starts `head` at an item boundary, with at least one item after it (`repeats`:
    or none, and then a list that is a leading part of a kept one is not kept). The state
    is shared: whoever resumes from it must not change it. Bounded by bytes over all scopes
    (least recently used scope first); thread-safe."""

    def __init__(self, max_bytes: int = 64 << 20, per_scope: int = LISTS_PER_SCOPE, *,
                 repeats: bool = False) -> None:
        self.repeats = repeats
        self._states: ScopedEntries[_State] = ScopedEntries(max_bytes, per_scope)
        self._lock = threading.Lock()
        self.hits = 0

    @property
    def max_bytes(self) -> int:
        return self._states.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self._states.max_bytes = value

    @property
    def size_bytes(self) -> int:
        return self._states.size_bytes

    def find(self, scope: bytes, context: bytes, head: bytes) -> tuple[int, Any] | None:
        """(items, state) of the longest kept leading part of the list whose JSON bytes,
        less the closing bracket, are `head`; or None."""
        best: _State | None = None
        with self._lock:
            for kept in self._states.of(scope):
                n = len(kept.head)
                # (the context last: a toolset's JSON, the same for all its conversations)
                if (best is None or kept.count > best.count) \
                        and ((n < len(head) and head[n] == 0x2C)  # ",": an item follows
                             or (self.repeats and n == len(head))) \
                        and head.startswith(kept.head) and kept.context == context:
                    best = kept
            if best is None:
                return None
            self.hits += 1
            self._states.touch(scope)
        return best.count, best.state

    def keep(self, scope: bytes, context: bytes, head: bytes, count: int, state: Any,
             size: int | None = None) -> None:
        """Keep `state`, the pass's after the first `count` items of a list whose JSON bytes
        up to the end of those items are `head` (`size`: the bytes it is counted for)."""
        new = _State(context, head, count, state, size)
        if count < 1 or new.size > self.max_bytes:
            return
        with self._lock:
            states = self._states.of(scope)
            if self.repeats and any(k.context == context and k.head.startswith(head)
                                    for k in states):
                self._states.touch(scope)
                return  # a leading part of a kept one (a retry, a hint's sub-split)
            # (superseded: the new one goes at least as far)
            self._states.put(scope, new, [k for k in states
                                          if k.context == context and head.startswith(k.head)])

    def clear(self) -> None:
        with self._lock:
            self._states.clear()


@dataclass
class ConversionMemos:
    """What spares a caller's turn the work its earlier turns did at an edge whose messages
    are converted with state carried between them (Anthropic's): the messages' shapes
    (`shapes`) and the conversion's state before a turn (`turns`), both per caller scope (a
    caller's namespace: callers never share an entry)."""

    shapes: MessageMemo = field(default_factory=MessageMemo)
    turns: PrefixStates = field(default_factory=PrefixStates)
