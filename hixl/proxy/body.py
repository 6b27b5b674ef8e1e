"""A client's request body, from bytes to the JSON object the proxy forwards, or the reason it is refused.

No I/O here: :func:`parse` takes the whole body and returns the object or
raises :class:`BadBody`, whose message is the client's 400. Whatever the
bytes are, nothing else escapes: the proxy answers a malformed request with
a 400 it can explain, never a 500, and never forwards what an upstream could
choke on where the proxy could have said why (a number JSON cannot write back,
nesting deeper than re-encoding it takes).
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

__all__ = ["FIELD_TYPES", "MAX_DEPTH", "BadBody", "parse"]

#: The deepest nesting of arrays and objects a body may have. Real requests nest a few levels
#: (a chat message's content parts), a tool's JSON schema a few dozen; the limit keeps the
#: parse and the re-encoding for upstreams far from Python's recursion limit.
MAX_DEPTH = 128

#: The fields the proxy reads, rewrites or routes on, and the JSON types each may have besides
#: null. Checked here so that the client hears what is wrong before a prefill is spent on it;
#: everything else in the body is the upstream's to judge.
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "prompt": (str, list),
    "messages": (list,),
    "stream": (bool,),
    "stream_options": (dict,),
    "max_tokens": (int,),
    "max_completion_tokens": (int,),
}

_TYPE_NAMES = {
    str: "a string", list: "an array", dict: "an object", bool: "a boolean", int: "an integer", float: "a number", type(None): "null"
}


class BadBody(Exception):
    """The body is not a request the proxy forwards; the message says why, for the client."""


def parse(payload: bytes) -> dict[str, Any]:
    """The request ``payload`` (a whole body) as a JSON object; raises :class:`BadBody`."""
    try:
        text = payload.decode("utf-8")  # JSON's only encoding between systems (RFC 8259)
    except UnicodeDecodeError as exc:
        raise BadBody(f"the request body is not UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:  # (the C parser's own depth check, far past MAX_DEPTH)
        raise BadBody(_TOO_DEEP) from None
    except json.JSONDecodeError as exc:
        raise BadBody(f"the request body is not JSON: {exc}") from None
    except ValueError:  # the one other: an integer past CPython's digit limit (vLLM's parser has it too)
        raise BadBody("the request body has an integer with more digits than the proxy reads") from None
    if not isinstance(body, dict):
        raise BadBody(f"the request body must be a JSON object, not {_type_name(body)}")
    if _depth(body) > MAX_DEPTH:
        raise BadBody(_TOO_DEEP)
    for name, types in FIELD_TYPES.items():
        value = body.get(name)
        # (JSON's true and false are no integers, though Python's bool is an int.)
        if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise BadBody(f'"{name}" must be {" or ".join(_TYPE_NAMES[t] for t in types)}, not {_type_name(value)}')
    return body


_TOO_DEEP = f"the request body nests arrays and objects deeper than {MAX_DEPTH} levels"


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # JSON cannot write it back: upstreams would be sent "Infinity"
        raise BadBody(f"the request body has a number beyond a double's range ({text[:20]}{'...' if len(text) > 20 else ''})")
    return value


def _no_constant(name: str) -> NoReturn:
    raise BadBody(f"the request body has {name}, which is not JSON")


def _depth(body: dict[str, Any]) -> int:
    """How deeply ``body``'s objects and arrays nest (itself: 1; past MAX_DEPTH: MAX_DEPTH + 1), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(body, 1)]  # (an object or an array, its depth)
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            break  # deep enough to refuse: the rest need not be walked
        # Only containers are stacked: a prompt of token ids is one list of many ints, walked once.
        stack += [(child, depth + 1) for child in (item.values() if type(item) is dict else item) if type(child) in (dict, list)]
    return deepest


def _type_name(value: Any) -> str:
    return _TYPE_NAMES[type(value)]
