"""One log line per finished generation (logger `server.requests`, INFO): what it cost and how
much of it the drafter wrote, so the server's log shows speculation at work."""

from __future__ import annotations

import logging

from server.engine import GenerationStats

log = logging.getLogger("server.requests")


def log_finished(endpoint: str, finish_reason: str, stats: GenerationStats,
                 request_id: str | None = None) -> None:
    """`/v1/chat/completions stop [req_...]: prompt 41 ...`; the same fields, and the stats,
    are the record's own for a JSON log (`server.logs`)."""
    if not log.isEnabledFor(logging.INFO):
        return
    log.info("%s %s [%s]: %s", endpoint, finish_reason, request_id or "-", summary(stats),
             extra={"request_id": request_id, "endpoint": endpoint,
                    "finish_reason": finish_reason, "stats": stats.to_dict()})


def summary(stats: GenerationStats) -> str:
    """`prompt 41 (0 cached), 32 generated in 1.45 s (TTFT 0.32 s, 28.4 tok/s); drafts:
    23/31 accepted (74%) by prompt_lookup+draft`"""
    text = (f"prompt {stats.prompt_tokens} ({stats.cached_tokens} cached), "
            f"{stats.generation_tokens} generated in {stats.total_s:.2f} s "
            f"(TTFT {stats.ttft_s:.2f} s, {stats.generation_tps:.1f} tok/s)")
    if not stats.draft_tokens_proposed:
        return f"{text}; no drafts"
    return (f"{text}; drafts: {stats.draft_tokens_accepted}/{stats.draft_tokens_proposed} "
            f"accepted ({stats.acceptance_rate:.0%}) by {stats.draft_model}")
