"""Lists as OpenAI's API pages them (files, batches, a response's or a conversation's
items): ``items_page``. No engine or JAX imports: the replicas' front pages its merged
lists with it too."""

from __future__ import annotations

from server.errors import APIError


MAX_FILES_LIMIT = 10_000   # ``GET /v1/files`` takes up to 10,000 a page (OpenAI's limit and default)


def items_page(items: list[dict], limit: int, order: str, after: str | None, where: str,
               max_limit: int = 100) -> dict:
    """A page of ``items`` (each with an ``id``) as the API lists them: ``limit`` (1 to
    ``max_limit``: 100 for most lists) of them, ``order`` "asc" (as added) or "desc" (last
    first), after the item ``after``; bad values are 400s naming the parameter (``where``:
    the list's owner, for the message)."""
    if not 1 <= limit <= max_limit:
        raise APIError(400, f"limit: must be in [1, {max_limit}], got {limit}", param="limit")
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
