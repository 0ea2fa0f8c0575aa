"""Lists as OpenAI's API pages them (files, batches, a response's or a conversation's
items): ``items_page``. No engine or JAX imports: the replicas' front pages its merged
lists with it too."""

from __future__ import annotations

from server.errors import APIError


def items_page(items: list[dict], limit: int, order: str, after: str | None, where: str) -> dict:
    """A page of ``items`` (each with an ``id``) as the API lists them: ``limit`` (1-100) of
    them, ``order`` "asc" (as added) or "desc" (last first), after the item ``after``;
    bad values are 400s naming the parameter (``where``: the list's owner, for the message)."""
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit: must be in [1, 100], got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order: must be 'asc' or 'desc', got {order!r}", param="order")
    items = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        start = next((i + 1 for i, item in enumerate(items) if item["id"] == after), None)
        if start is None:
            raise APIError(400, f"after: no item {after!r} in {where}", param="after")
    page = items[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}
