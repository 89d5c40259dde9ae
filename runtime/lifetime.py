"""Releasing driver objects at the right time.

Freeing memory or destroying a graph while a stream is being captured invalidates the
capture, and a garbage-collected buffer or graph can be finalized at any moment, including
inside a `ptxattn.capture` block. Finalizers therefore go through `release`, which runs them
at once normally and after the last active capture ends otherwise.
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
_active_captures = 0
_pending: list = []


def release(fn, *args) -> None:
    with _lock:
        if _active_captures:
            _pending.append((fn, args))
            return
    fn(*args)


def capture_started() -> None:
    global _active_captures
    with _lock:
        _active_captures += 1


def capture_ended() -> None:
    global _active_captures
    with _lock:
        _active_captures -= 1
        ready = _pending[:] if _active_captures == 0 else []
        if ready:
            _pending.clear()
    for fn, args in ready:
        fn(*args)
