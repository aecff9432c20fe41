"""`never_raises`: the data path's one guard turns an exception into a miss and logs once."""

from __future__ import annotations

import logging

import pytest

from offload.store.base import all_false, never_raises


class Flaky:
    def __init__(self) -> None:
        self.fail = True

    @never_raises("flaky get", all_false)
    def get_many(self, keys: list[bytes]) -> list[bool]:
        if self.fail:
            raise OSError("disk gone")
        return [True] * len(keys)


def test_exception_becomes_the_miss_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    f = Flaky()
    with caplog.at_level(logging.WARNING):
        assert f.get_many([b"a", b"b"]) == [False, False]
        assert f.get_many([b"c"]) == [False]
        assert f.get_many([b"c"]) == [False]
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and "flaky get failed" in errors[0].getMessage()
    assert errors[0].exc_info is not None                      # the first one with its traceback
    assert Flaky.get_many.failures.failures == 3               # type: ignore[attr-defined]
    f.fail = False
    assert f.get_many([b"d"]) == [True]


def test_a_summary_at_most_once_a_minute(caplog: pytest.LogCaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import offload.store.base as base

    @never_raises("boom", lambda: 0)
    def boom() -> int:
        raise ValueError("x")

    clock = [1000.0]
    monkeypatch.setattr(base.time, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            boom()
        clock[0] += base.SUMMARY_EVERY_S + 1
        assert boom() == 0
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(msgs) == 2 and "failed 5 more times" in msgs[1]
