"""The transport of ``soakd.client.transport`` is on, and exact.

The socket stamps lean on a detail of aiohttp (``TCPConnector._factory``); when an upgrade changes it,
soakd stamps events when read and the first test here fails, naming what changed, so that the fallback
is a decision, not an accident (benchmarks/client_capacity.py measures what it is worth).

- ``parse_event`` is ``json.loads`` (orjson, the standard library for what orjson refuses): same value,
  same exception type;
- the request-body encoder gives what ``json.dumps(body, separators=(",", ":"))`` means (the same value
  parsed back; non-finite floats as null);
- connections stamp the arrival of bytes (``StampedResponseHandler``).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from soakd.client import transport
from soakd.client.openai import OpenAIClient
from soakd.config import TargetConfig
from soakd.core.records import Outcome, RequestRecord

pytestmark = pytest.mark.timeout(60)


async def test_the_tricks_are_on_in_this_aiohttp_and_cpython() -> None:
    assert await transport.stamping_supported(), (
        f"aiohttp {aiohttp.__version__} no longer builds connections with TCPConnector._factory = "
        "functools.partial(ResponseHandler, ...): soakd's events are stamped when read, not when they "
        "arrive; adapt soakd/client/transport.py:_stamp and re-run benchmarks/client_capacity.py")
    assert await transport.status() == {"socket_stamps": True, "orjson": True}


def test_request_headers_carry_the_key_and_the_target_headers() -> None:
    target = TargetConfig(headers={"X-Team": "a", "X-Api-Key": "k-1"})
    h = transport.request_headers(target, "sk-1")
    assert h["Authorization"] == "Bearer sk-1" and h["X-Team"] == "a" and h["Content-Type"] == "application/json"
    assert h["X-Api-Key"] == "k-1"  # a credential header (a SecretStr in the config) goes out as given
    assert "Authorization" not in transport.request_headers(target, None)


# ---- JSON ------------------------------------------------------------------------------------

GOOD = [b'{"a": 1}', b'{"choices":[{"delta":{"content":"\\u00e9\xc3\xa9"}}]}', b"[1, 2]", b'"s"', b"3.5",
        b"null", b" {\"a\": 1} ", b'{"a": NaN}', b"\xef\xbb\xbf{}", b'{"a": -Infinity}',
        b'"\\ud800"', b'{"a": 1, "a": 2}', b"1e400", b"-0.0"]
BAD = [b"", b"{", b'{"a": 1} x', b"{'a': 1}", b"\xff\xfe{}", b'{"a": "\xc3"}', b"[DONE]", b"  "]


@pytest.mark.parametrize("data", GOOD + BAD)
def test_parse_event_is_json_loads(data: bytes) -> None:
    try:
        want: Any = json.loads(data)
    except ValueError as exc:
        with pytest.raises(type(exc)):
            transport.parse_event(data)
        return
    got = transport.parse_event(data)
    assert json.dumps(got) == json.dumps(want)


def test_an_integer_beyond_64_bits_in_an_event_is_a_float() -> None:
    """orjson's one difference from json.loads on what it accepts (no server sends such a count)."""
    assert transport.parse_event(b"[18446744073709551616]") == [float(2**64)]


def test_body_encoder_means_what_json_dumps_means() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "caf\u00e9 \u2028 \"q\"\n\t\x00 \U0001f600"}],
            "max_tokens": 16, "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True},
            "x": [None, 1.5, -0.0, 2**63 - 1, 0.1 + 0.2], "y": {"z": False}, "t": (1, 2)}
    got = transport.encode_body(body)
    assert isinstance(got, bytes) and b" " not in got.replace(b"\xe2\x80\xa8", b"").split(b'"content":')[0]
    assert json.loads(got) == json.loads(json.dumps(body, separators=(",", ":")))
    assert list(json.loads(got)) == list(body)  # the keys in the body's order
    # what orjson cannot encode is json.dumps's: an integer beyond 64 bits
    odd = {"n": 10**20, "k": {1: "a"}}
    assert transport.encode_body(odd) == json.dumps(odd, separators=(",", ":")).encode()
    # non-string keys (a logit_bias of token ids from YAML) as json.dumps writes them, through orjson
    bias = {"logit_bias": {50256: -100, 13: 5}, "flags": {True: 1, None: 2}}
    assert json.loads(transport.encode_body(bias)) == json.loads(json.dumps(bias))
    # a non-finite float is null (json.dumps would write NaN, which no server accepts)
    assert json.loads(transport.encode_body({"x": float("inf"), "y": float("nan")})) == {"x": None, "y": None}



# ---- stamped connections ---------------------------------------------------------------------

async def test_connections_stamp_byte_arrival() -> None:
    from helpers import sim_server

    async with sim_server(ttft_base=0.01, tpot_base=0.002, tpot_per_batch=0, ttft_per_prompt_token=0, jitter=0) as sim:
        client = OpenAIClient(TargetConfig(url=sim.base_url))
        rec = RequestRecord("test")
        try:
            body = {"model": "soakd-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                    "stream": True}
            await client.execute(rec, body)
            protocols = [p for conns in client.session.connector._conns.values() for p, _ in conns]  # noqa: SLF001
        finally:
            await client.close()
    assert rec.outcome is Outcome.OK, rec
    assert protocols and all(type(p) is transport.StampedResponseHandler for p in protocols)
    t = rec.token_times_ns
    assert rec.t_start_ns < rec.t_headers_ns <= t[0] and t == sorted(t) and t[-1] <= rec.t_end_ns


async def test_idle_pooled_connections_are_dropped_before_the_servers_close_them() -> None:
    """uvicorn (vLLM, SGLang) and llama-server close a keep-alive connection idle for 5 s; a pool that keeps
    it longer reuses one the server is closing and loses the request (a connection error with the target up,
    seen after quiesce pauses in the vLLM e2e test). Kept below 5 s; none kept with keep-alive off."""
    conn = transport.build_connector(TargetConfig(url="http://127.0.0.1:1/v1"), 4)
    closed = transport.build_connector(TargetConfig(url="http://127.0.0.1:1/v1", keep_alive=False), 4)
    try:
        assert 0 < conn._keepalive_timeout < 5.0  # noqa: SLF001
        assert closed.force_close
    finally:
        await conn.close()
        await closed.close()


def test_request_headers_name_soakd_as_the_user_agent_unless_the_target_names_one() -> None:
    import soakd

    assert transport.request_headers(TargetConfig(), None)["User-Agent"] == f"soakd/{soakd.__version__}"
    h = transport.request_headers(TargetConfig(headers={"USER-AGENT": "canary/1"}), None)
    assert [k for k in h if k.lower() == "user-agent"] == ["USER-AGENT"] and h["USER-AGENT"] == "canary/1"
