"""hixl's wire protocol, free of I/O: bytes in, messages out, and back.

See :mod:`hixl._protocol.frames` for the frame layout.
"""

from .frames import (
    HEADER_SIZE,
    Ack,
    Bye,
    Data,
    Error,
    FrameType,
    Header,
    Hello,
    Message,
    Meta,
    Notify,
    Ping,
    Pong,
    QueryMeta,
    QueryRegions,
    ReadRequest,
    Regions,
    Welcome,
    WriteRequest,
    encode,
    parse_body,
    parse_header,
)

__all__ = [
    "HEADER_SIZE",
    "Ack",
    "Bye",
    "Data",
    "Error",
    "FrameType",
    "Header",
    "Hello",
    "Message",
    "Meta",
    "Notify",
    "Ping",
    "Pong",
    "QueryMeta",
    "QueryRegions",
    "ReadRequest",
    "Regions",
    "Welcome",
    "WriteRequest",
    "encode",
    "parse_body",
    "parse_header",
]
