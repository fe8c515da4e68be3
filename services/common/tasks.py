"""Running several calls at once under asyncio."""

from __future__ import annotations

import asyncio


async def gather_or_cancel(calls) -> list:
    """gather(), but the first failure (or the caller's cancellation) cancels the other calls and
    waits for them to end instead of leaving them running."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
