"""The described API: schemathesis generates requests from /openapi.json and sends them to a
running router (uvicorn on loopback, no engine registered: every valid generation request ends
in a documented 503); no answer may be a 5xx other than that documented one, every body must
match its declared model, and every status code must be one the operation documents."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from router.config import RouterConfig
from tests.router.conftest import serve_router

pytestmark = pytest.mark.slow
EXAMPLES = 40  # per operation


@pytest.fixture(scope="module")
def router_url(model_info):
    config = RouterConfig(engine_wait_timeout_s=0, num_prepare_workers=0, max_model_len=256)
    with serve_router(config, model_info) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(router_url):
    return schemathesis.openapi.from_url(f"{router_url}/openapi.json")


def test_every_answer_is_documented(api_schema):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    for operation in operations:
        _fuzz(operation)


def _fuzz(operation) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        response = case.call(timeout=30)
        assert response.status_code < 500 or response.status_code == 503, (
            f"{case.method} {case.path}: {response.status_code} {response.text[:300]}")
        case.validate_response(response, checks=[
            status_code_conformance, content_type_conformance,
            response_schema_conformance])

    run()
