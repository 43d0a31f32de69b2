"""`acespec bench fuzz-http` at a small size: schema-generated, mutated and malformed requests to a
real `acespec edge serve` and a real `acespec serve`'s HTTP port give no 5xx but 503, no hang, and
both still serve a valid request after."""

from __future__ import annotations

from acespec.bench.fuzz_http import run_fuzz_http


def test_a_small_campaign_gets_no_server_error_and_no_hang():
    res = run_fuzz_http(1500, threads=6, seed=7, timeout=20.0, log=lambda s: None)
    assert res.requests == 1500
    assert res.failures == 0 and res.hangs == 0, res.examples
    assert res.valid_after
    # the campaign reached every kind of request, and the API answered some of them with text
    assert set(res.by_kind) >= {"schema", "mutated", "bytes", "nested", "cloud-port"}
    assert res.by_status.get("200", 0) > 0 and res.by_status.get("422", 0) > 0
