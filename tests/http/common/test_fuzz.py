"""Schemathesis against the app in process (issue 12): every operation of /openapi.json, with
data that fits the schema and data that does not; no 5xx, every response as the document says.

Bounded for CI: FUZZ_EXAMPLES cases per operation and mode (default 100) within FUZZ_BUDGET_S
seconds in all (default 180), each operation and mode a fair share of the time left. Token
budgets are kept small, so the cost is HTTP, not generation.
A longer run (about 8,000 cases):
`FUZZ_EXAMPLES=1000 FUZZ_BUDGET_S=600 pytest tests/test_fuzz.py -s`.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
from support.http import chat_body
from support.servers import make_settings

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "100"))
BUDGET_S = float(os.environ.get("FUZZ_BUDGET_S", "180"))
MAX_TOKENS = 3
# Schemathesis waits 10 s by default; a CI machine busy with other tests can take longer.
REQUEST_TIMEOUT_S = 60
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance, negative_data_rejection]


@dataclass
class Tally:
    cases: int = 0
    per_operation: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    server_errors: list = field(default_factory=list)
    violations: list = field(default_factory=list)

    def report(self) -> str:
        codes = ", ".join(f"{code}: {n}" for code, n in sorted(self.statuses.items()))
        per = ", ".join(f"{op}: {n}" for op, n in sorted(self.per_operation.items()))
        return (f"schemathesis: {self.cases} cases, {len(self.server_errors)} 5xx, "
                f"{len(self.violations)} schema violations; statuses {codes}; cases {per}")


# The token budget fields of each generation route, and the one a body without it gets (none
# for /v1/messages, where max_tokens is required: adding it would make a bad body good).
BUDGETS = {
    "/v1/chat/completions": (("max_tokens", "max_completion_tokens"), "max_tokens"),
    "/v1/completions": (("max_tokens",), "max_tokens"),
    "/v1/responses": (("max_output_tokens",), "max_output_tokens"),
    "/v1/messages": (("max_tokens",), None),
    "/completion": (("n_predict",), "n_predict"),  # llama.cpp's: -1 (the default) fills the
    "/infill": (("n_predict",), "n_predict"),  # context
}


def keep_small(case) -> None:
    """Generation is not what is under test: cap the token budget of generation routes, and
    of each request of a message batch (which runs in the background)."""
    body = case.body
    if case.path == "/v1/messages/batches" and isinstance(body, dict):
        requests = body.get("requests")
        for request in requests if isinstance(requests, list) else []:
            params = request.get("params") if isinstance(request, dict) else None
            if isinstance(params, dict):
                cap_budget(params, "/v1/messages")
        return
    if isinstance(body, dict) and case.path in BUDGETS:
        cap_budget(body, case.path)


def cap_budget(body: dict, path: str) -> None:
    names, default = BUDGETS[path]
    for name in names:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and (
                value > MAX_TOKENS or value < 0 and name == "n_predict"):
            body[name] = MAX_TOKENS
    if default is not None:
        body.setdefault(default, MAX_TOKENS)  # not required: adding it keeps a bad body bad


@pytest.fixture()
def fuzz_app(tiny_pair, model_dir):
    """A fresh engine: the fuzzer unloads the draft. No keys, loopback: every route reachable;
    the target embeds too, so /v1/embeddings computes."""
    from server.http.app import build_engine, create_app

    settings = make_settings(*tiny_pair)
    settings.models.model_roots = [str(model_dir)]
    settings.models.embedding_model = str(tiny_pair[0])
    engine = build_engine(settings)
    engine.start()
    try:
        yield create_app(settings, engine)
    finally:
        engine.stop()


class OutOfTime(Exception):
    """Ends one operation's run at its deadline (generating cases costs time too)."""


def _fuzz(operation, mode, tally: Tally, deadline: float) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        if time.monotonic() > deadline and tally.per_operation[operation.label]:
            raise OutOfTime
        keep_small(case)
        response = case.call(timeout=REQUEST_TIMEOUT_S)
        tally.cases += 1
        tally.per_operation[operation.label] += 1
        tally.statuses[response.status_code] += 1
        label = f"{operation.label} {mode.value} -> {response.status_code}"
        if response.status_code >= 500:
            tally.server_errors.append(f"{label}: {case.body!r:.300} {response.text[:300]}")
        try:
            case.validate_response(response, checks=CHECKS)
        except (AssertionError, FailureGroup) as failure:  # a check failed: count it, go on
            if response.status_code < 500:
                tally.violations.append(f"{label}: {case.body!r:.300}: {failure!s:.500}")

    try:
        run()
    except OutOfTime:
        pass
    except Unsatisfiable:  # nothing to get wrong: no parameters, no body (GET /health)
        assert mode == GenerationMode.NEGATIVE, operation.label


@pytest.mark.slow
def test_fuzz_every_operation(fuzz_app, capsys):
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 13, [op.label for op in operations]
    tally, end = Tally(), time.monotonic() + BUDGET_S
    runs = [(op, mode) for op in operations
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    for i, (operation, mode) in enumerate(runs):  # each run a fair share of the time left
        now = time.monotonic()
        _fuzz(operation, mode, tally, now + max(end - now, 0) / (len(runs) - i))
    with capsys.disabled():
        print("\n" + tally.report())
    assert set(tally.per_operation) == {op.label for op in operations}, tally.per_operation
    assert tally.server_errors == [], "\n".join(tally.server_errors[:10])
    assert tally.violations == [], "\n".join(tally.violations[:10])

    from starlette.testclient import TestClient

    with TestClient(fuzz_app) as client:  # still serving, and serving normally
        r = client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert client.get("/health").json()["status"] == "ok"
