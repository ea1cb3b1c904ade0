"""The protobuf wire format read and written by hand (encoding guide, "Message Structure"), for tests that build
requests protobuf itself would not write (unknown fields, fields out of order)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5


class WireError(ValueError):
    """Not a well-formed message."""


def read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while pos < end and shift < 64:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
    raise WireError("truncated or overlong varint")


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


@dataclass(frozen=True)
class Field:
    number: int
    wire_type: int
    start: int  # the tag's first byte
    value_start: int  # LEN: the payload's first byte (after the length)
    end: int


def fields(buf: bytes) -> Iterator[Field]:
    """The top-level fields of message ``buf``, in wire order."""
    pos, end = 0, len(buf)
    while pos < end:
        tag, vpos = read_varint(buf, pos, end)
        number, wt = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        if wt == VARINT:
            _, nxt = read_varint(buf, vpos, end)
        elif wt == LEN:
            n, vpos = read_varint(buf, vpos, end)
            nxt = vpos + n
        elif wt == I64:
            nxt = vpos + 8
        elif wt == I32:
            nxt = vpos + 4
        else:
            raise WireError(f"wire type {wt} (groups) not handled")
        if nxt > end:
            raise WireError(f"field {number} runs past the message")
        yield Field(number, wt, pos, vpos, nxt)
        pos = nxt
