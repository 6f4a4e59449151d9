"""Pages of the list RPCs (nodes, events, the checkpoint catalog): how many items, how many bytes,
and tokens that only this server hands out.

================================  =========  ===================================================
``DEFAULT_PAGE_SIZE``             1000       items per page when the client sets none
``MAX_PAGE_SIZE``                 5000
``MAX_PAGE_BYTES``                2 MiB      a page stops growing here (the first item always
                                             fits), well under gRPC's default 4 MiB receive limit
``MAX_PAGE_TOKEN``                512        a token is the last key of the page before
================================  =========  ===================================================
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from . import errors
from .validation import shown

T = TypeVar("T")

DEFAULT_PAGE_SIZE = 1000
MAX_PAGE_SIZE = 5000
MAX_PAGE_BYTES = 2 * 1024 * 1024
MAX_PAGE_TOKEN = 512


@dataclass(frozen=True)
class Page:
    size: int  # items at most
    token: str  # where to start ("" = the beginning)


def page(page_size: int, page_token: str, token_re: str = r"[A-Za-z0-9._/:-]{0,512}") -> Page:
    """A list request's page: ``page_size`` 0 means :data:`DEFAULT_PAGE_SIZE`."""
    if page_size < 0 or page_size > MAX_PAGE_SIZE:
        raise errors.InvalidArgument("page_size", f"must be in [0, {MAX_PAGE_SIZE}], got {page_size}")
    if len(page_token) > MAX_PAGE_TOKEN or re.fullmatch(token_re, page_token) is None:
        raise errors.InvalidArgument("page_token", f"{shown(page_token)} is not a token this server handed out")
    return Page(page_size or DEFAULT_PAGE_SIZE, page_token)


def take_page(items: Iterable[T], size: int, byte_size: Callable[[T], int],
              max_bytes: int = MAX_PAGE_BYTES) -> tuple[list[T], bool]:
    """The first of ``items`` (consumed lazily) that fit ``size`` items and ``max_bytes`` (the first
    always fits); ``True`` when some were left out."""
    out: list[T] = []
    used = 0
    for item in items:
        cost = byte_size(item) + 8  # the field's tag and length
        if len(out) >= size or (out and used + cost > max_bytes):
            return out, True
        out.append(item)
        used += cost
    return out, False
