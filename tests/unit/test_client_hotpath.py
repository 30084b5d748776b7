"""The streaming client's fast paths are exact: each one against the plain code it replaces.

- ``SSEDecoder.feed_data`` returns the data of the events ``feed`` returns, for every split;
- the per-request deadline arms one timer no later than any deadline, moves later lazily and
  earlier at once (driven by a fake clock: no real time involved).

The transport tricks (JSON, socket stamps) are tested in test_transport.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest

from soakd.client import openai as oc
from soakd.client.sse import SSEDecoder

pytestmark = pytest.mark.timeout(60)


# ---- SSE -------------------------------------------------------------------------------------

def _event(i: int) -> bytes:
    return b"data: " + json.dumps({"choices": [{"delta": {"content": "t\u00e9" * i}}]}, ensure_ascii=False).encode()


STREAMS = {
    "openai": b"".join(_event(i) + b"\n\n" for i in range(6)) + b"data: [DONE]\n\n",
    "mixed": (b"data: a\n\n\n\ndata:b\n\n: keep-alive\n\nevent: x\n\ndata\n\ndata:  sp\n\n"
              b"id: 4\ndata: q\ndata: r\n\n\ndata: \n\nevent: e\ndata: z\n\ndata: tail"),
    "crlf": b"data: a\r\n\r\ndata: b\r\n\r\n",
}


def _decode(chunks: list[bytes], fast: bool) -> list[bytes]:
    dec = SSEDecoder()
    out: list[bytes] = []
    for c in chunks:
        out.extend(dec.feed_data(c) if fast else [ev.data for ev in dec.feed(c)])
    out.extend(ev.data for ev in dec.close())
    return out


@pytest.mark.parametrize("name", list(STREAMS))
def test_feed_data_is_feed_for_every_two_cut_split(name: str) -> None:
    data = STREAMS[name]
    for i, j in itertools.combinations(range(len(data) + 1), 2):
        chunks = [data[:i], data[i:j], data[j:]]
        assert _decode(chunks, True) == _decode(chunks, False), (i, j)


def test_feed_data_whole_openai_stream() -> None:
    assert SSEDecoder().feed_data(STREAMS["openai"])[-1] == b"[DONE]"
    assert SSEDecoder().feed_data(b"data: a\n\ndata: b\nc\n\n") == [b"a", b"b"]  # 'c': an unknown field, ignored


# ---- the deadline ----------------------------------------------------------------------------

class FakeLoop:
    """call_at/time on a clock the test moves; handles fire only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0
        self.handles: list[asyncio.TimerHandle] = []
        self.real = asyncio.get_running_loop()

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, cb: Any, *args: Any) -> asyncio.TimerHandle:
        h = asyncio.TimerHandle(when, cb, args, self.real)
        self.handles.append(h)
        return h

    def armed(self) -> list[float]:
        return [h.when() for h in self.handles if not h.cancelled()]

    def advance(self, t: float) -> None:
        """Move the clock to ``t`` and run every live timer due by then (in time order)."""
        self.now = t
        while True:
            due = sorted((h for h in self.handles if not h.cancelled() and h.when() <= t), key=lambda h: h.when())
            if not due:
                return
            h = due[0]
            self.handles.remove(h)
            h._run()  # noqa: SLF001


def _near(armed: list[float], t: float) -> bool:
    """One timer, armed within a wheel tick after ``t`` (the slot boundary that follows it)."""
    return len(armed) == 1 and t - 1e-9 <= armed[0] <= t + oc.TICK + 1e-9


async def _lazy_deadline_until_expiry() -> None:
    loop = FakeLoop()
    dl = oc._Deadline(loop, 0.0, first_s=10.0, idle_s=2.0, total_s=30.0)  # type: ignore[arg-type]  # noqa: SLF001
    with dl:
        assert _near(loop.armed(), 2.0), loop.armed()  # min(first, idle): no deadline the request can get is earlier
        loop.now = 0.5
        dl.streaming(0.5)  # first event: idle deadline 2.5, later than the armed slot -> nothing moves
        assert (dl.when, dl.phase) == (2.5, "idle") and _near(loop.armed(), 2.0)
        for t in (1.0, 1.9, 3.0, 4.2):  # events keep coming: a store each
            loop.advance(t)
            dl.when = min(dl.total_at, t + 2.0)
        # its slot came early twice (after 2.0 and after 3.9): added again for the deadline of that moment
        assert not dl.expired and _near(loop.armed(), 5.0), loop.armed()
        loop.advance(5.1)
        assert not dl.expired and _near(loop.armed(), 6.2), loop.armed()
        loop.advance(6.3)
        assert dl.expired
        await asyncio.sleep(0)  # the cancel lands here
    assert False, "the with block must raise TimeoutError"  # pragma: no cover


async def test_deadline_arms_once_moves_later_lazily_and_expires_as_timeout_error() -> None:
    with pytest.raises(TimeoutError):
        await _lazy_deadline_until_expiry()


async def test_deadline_first_token_wait_longer_than_idle_rearms_earlier() -> None:
    loop = FakeLoop()
    dl = oc._Deadline(loop, 0.0, first_s=10.0, idle_s=2.0, total_s=30.0)  # type: ignore[arg-type]  # noqa: SLF001
    with dl:
        loop.advance(2.1)  # still waiting for the first token: added again for the first-token deadline
        assert not dl.expired and _near(loop.armed(), 10.0), loop.armed()
        loop.now = 5.0
        dl.streaming(5.0)  # idle deadline 7.0 is earlier than the armed 10.0: moved at once
        assert _near(loop.armed(), 7.0), loop.armed()


async def test_many_deadlines_share_one_timer_and_leave_the_wheel_empty() -> None:
    """The wheel: every request's deadline in a slot, one timer for the earliest; a request that ends takes its
    deadline out (no timer armed or cancelled for it), and an empty wheel arms nothing."""
    loop = FakeLoop()
    wheel = oc._Wheel(loop)  # type: ignore[arg-type]  # noqa: SLF001
    dls = [oc._Deadline(loop, 0.01 * i, first_s=30.0, idle_s=30.0, total_s=60.0, wheel=wheel)  # type: ignore[arg-type]  # noqa: SLF001
           for i in range(200)]
    for dl in dls:
        dl.__enter__()
    assert _near(loop.armed(), 30.0) and sum(len(s) for s in wheel.slots.values()) == 200
    assert len(loop.handles) == 1  # one timer for all 200
    for dl in dls:
        dl.__exit__(None, None, None)
    assert wheel.slots == {}
    loop.advance(31.0)  # the timer finds nothing due, and arms nothing more
    assert loop.armed() == [] and not any(dl.expired for dl in dls)


async def test_a_deadline_moved_later_never_delays_an_earlier_slot() -> None:
    """A's slot comes early (its events kept coming) and A is added again for 5.0 while the timer runs: the timer
    must still come back for B's slot at 2.0, not for A's at 5.0."""
    loop = FakeLoop()
    wheel = oc._Wheel(loop)  # type: ignore[arg-type]  # noqa: SLF001
    a = oc._Deadline(loop, 0.0, first_s=1.0, idle_s=1.0, total_s=30.0, wheel=wheel)  # type: ignore[arg-type]  # noqa: SLF001
    b = oc._Deadline(loop, 0.0, first_s=2.0, idle_s=2.0, total_s=30.0, wheel=wheel)  # type: ignore[arg-type]  # noqa: SLF001
    release = asyncio.Event()

    async def hold(dl: Any) -> None:
        with dl:
            await release.wait()

    ta, tb = asyncio.create_task(hold(a)), asyncio.create_task(hold(b))
    await asyncio.sleep(0)  # both inside their deadlines
    a.when = 5.0
    loop.advance(1.1)
    assert not a.expired and a.slot is not None and _near(loop.armed(), 2.0), loop.armed()
    loop.advance(2.1)
    assert b.expired and not a.expired and _near(loop.armed(), 5.0), loop.armed()
    with pytest.raises(TimeoutError):
        await tb
    release.set()
    await ta
    assert wheel.slots == {} and not a.expired


async def test_deadline_total_caps_and_external_cancel_stays_a_cancel() -> None:
    loop = FakeLoop()
    dl = oc._Deadline(loop, 0.0, first_s=10.0, idle_s=20.0, total_s=3.0)  # type: ignore[arg-type]  # noqa: SLF001
    assert (dl.when, dl.armed) == (3.0, 3.0)
    task = asyncio.current_task()
    assert task is not None
    with pytest.raises(asyncio.CancelledError):
        with dl:
            task.cancel()  # someone else cancels the request: not a timeout
            await asyncio.sleep(0)
    task.uncancel()
    assert not dl.expired and dl.slot is None and dl.wheel.slots == {}  # out of the wheel (its timer finds nothing)
