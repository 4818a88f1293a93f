"""ControlPlane.run: the coroutine's own outcome, or a timeout that names what it waited for."""

import asyncio
import threading

import pytest

from torchft_lite.rpc.loop import control_plane


class OwnTimeout(TimeoutError):
    pass


def test_returns_the_coroutines_result():
    async def answer():
        return 42

    assert control_plane().run(answer(), 5.0, "the answer") == 42


@pytest.mark.parametrize("error", [OwnTimeout("the peer's deadline passed"), ValueError("bad"),
                                   TimeoutError("asyncio.timeout inside")])
def test_the_coroutines_own_error_is_raised_as_it_is(error):
    async def fail():
        raise error

    with pytest.raises(type(error)) as caught:
        control_plane().run(fail(), 15.0, "the failing call")
    # asyncio hands a plain TimeoutError over as a copy; the message is the coroutine's own either way
    assert type(caught.value) is type(error) and caught.value.args == error.args


def test_a_coroutine_that_overruns_is_cancelled_and_the_timeout_names_the_wait():
    cancelled = threading.Event()

    async def forever():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError, match=r"timed out after 0\.1s waiting for the slow call"):
        control_plane().run(forever(), 0.1, "the slow call")
    assert cancelled.wait(10.0)


def test_a_blocking_call_from_the_loop_thread_is_refused():
    plane = control_plane()

    async def nested():
        async def inner():
            return 1
        coro = inner()
        try:
            plane.run(coro, 1.0, "a nested call")
        except RuntimeError as exc:
            return str(exc)

    assert "control-plane thread" in plane.run(nested(), 5.0, "the outer call")
