"""The server's log: text lines (the default) or, with `server.log_format: json`, one JSON object
per line for log collectors, uvicorn's lines included: `time`, `level`, `logger`, `message`,
and whatever a record carries besides (a generation's `request_id`, `endpoint`,
`finish_reason` and `stats`)."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime",
                                                                         "color_message"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
                "level": record.levelname, "logger": record.name,
                "message": record.getMessage()}
        line.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure(level: str, fmt: str) -> dict | None:
    """Set up the root logger; uvicorn's `log_config` for `fmt` (None: uvicorn's own)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])  # no-op if already set up
    if fmt != "json":
        return None
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"json": {"()": JsonFormatter}},
            "handlers": {"json": {"class": "logging.StreamHandler", "formatter": "json"}},
            "loggers": {name: {"handlers": ["json"], "level": level.upper(), "propagate": False}
                        for name in ("uvicorn", "uvicorn.error", "uvicorn.access")}}
