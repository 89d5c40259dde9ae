"""Shared test set-up: GPU tests skip with the reason when no driver or device is usable,
and every test gets a fresh random generator whose seed is printed on failure."""
from __future__ import annotations

import functools
import os
import secrets

import numpy as np
import pytest


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    from ptxattn.driver import CudaUnavailableError, init
    from ptxattn.device import device_count

    try:
        init()
        if device_count() == 0:
            return "the CUDA driver reports no device"
    except CudaUnavailableError as exc:
        return str(exc)
    return None


def _unresolved_arguments(item) -> list[str]:
    """The test function's arguments that neither a fixture nor its parametrization supplies
    (pytest reports those only when the test sets up, which a skipped GPU test never does)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a Python test function
        return []
    params = getattr(getattr(item, "callspec", None), "params", {})
    return [name for name in info.argnames if name not in info.name2fixturedefs and name not in params]


def pytest_collection_modifyitems(config, items):
    unresolved = {item.nodeid: names for item in items if (names := _unresolved_arguments(item))}
    if unresolved:
        # A CPU run skips the GPU tests before their set-up: without this, a test whose
        # parametrize slid onto another function errors only on the GPU machine.
        raise pytest.UsageError("tests asking for arguments nothing supplies: " +
                                "; ".join(f"{nodeid}: {', '.join(names)}" for nodeid, names in unresolved.items()))
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    reason = gpu_unavailable_reason()
    if reason:
        skip = pytest.mark.skip(reason=f"GPU test: {reason}")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """Fresh random data every run; PTXATTN_SEED=<n> replays a failure."""
    seed = int(os.environ.get("PTXATTN_SEED", secrets.randbits(32)))
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None:
        for key, value in item.user_properties:
            if key == "seed":
                print(f"\n[{item.nodeid}] replay with PTXATTN_SEED={value}")
