"""DELETE /v1/cache: empty the prefix cache, in memory and on disk, and the answers suffix
drafting keeps (admin)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from api_schemas.admin import CacheCleared
from server.http.common.auth import require_admin_key, require_api_key
from server.http.common.bodies import OffLoopJson

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["cache"],
                   route_class=OffLoopJson)


@router.delete("/cache", dependencies=[Depends(require_admin_key)])
async def clear_cache(request: Request) -> CacheCleared:
    entries, disk_entries, answers = await request.app.state.engine.clear_cache()
    return CacheCleared(entries=entries, disk_entries=disk_entries, suffix_answers=answers)
