"""One rule per argument across every op, each refused before any device work with the op, the
argument, what was expected and what came: missing arrays, flags that are not bools, a
workspace that is not a device array, read-only NumPy arrays an op updates, NumPy index values
outside their range (checked on the host before any upload), and the window and sinks rules
that sdpa and decode share."""
from __future__ import annotations

import numpy as np
import pytest

import ptxattn

F16 = np.float16
B, HQ, HKV, D, CAP = 2, 8, 2, 64, 128


def ones(*shape, dtype=F16):
    return np.ones(shape, np.float32).astype(dtype)


def decode_args():
    return [ones(B, HQ, 1, D), ones(B, HKV, CAP, D), ones(B, HKV, CAP, D), np.array([3, CAP], np.int32)]


def paged_args():
    table = np.arange(2 * 4, dtype=np.int32).reshape(2, 4)
    return [ones(B, HQ, 1, D), ones(8, HKV, 16, D), ones(8, HKV, 16, D), table, np.array([3, 64], np.int32)]


def append_args():
    return [ones(B, HKV, 1, D), ones(B, HKV, 1, D), ones(B, HKV, CAP, D), ones(B, HKV, CAP, D),
            np.array([3, 7], np.int32)]


@pytest.mark.parametrize("op, args, index, name", [
    (ptxattn.decode, decode_args, 0, "q"),
    (ptxattn.decode, decode_args, 3, "seq_lens"),
    (ptxattn.paged_decode, paged_args, 3, "block_table"),
    (ptxattn.kv_append, append_args, 4, "seq_lens"),
    (ptxattn.sdpa, lambda: [ones(1, 2, 3, D)] * 3, 0, "q"),
    (ptxattn.softmax, lambda: [ones(3, 4)], 0, "x"),
    (ptxattn.merge_states, lambda: [ones(1, 2, 3, D), ones(1, 2, 3, dtype=np.float32)] * 2, 0, "o_a"),
])
def test_missing_array_is_named(op, args, index, name):
    values = args()
    values[index] = None
    with pytest.raises(TypeError, match=rf"{op.__name__}: {name} is required, got None"):
        op(*values)


def test_flags_must_be_bools():
    with pytest.raises(TypeError, match="decode: return_lse must be True or False, got 'no'"):
        ptxattn.decode(*decode_args(), return_lse="no")
    with pytest.raises(TypeError, match="kv_append: advance must be True or False, got 'no'"):
        ptxattn.kv_append(*append_args(), advance="no")
    with pytest.raises(TypeError, match="sdpa: causal must be True or False, got 1"):
        ptxattn.sdpa(*[ones(1, 2, 3, D)] * 3, causal=1)


def test_workspace_must_be_a_device_array():
    with pytest.raises(TypeError, match=r"decode: workspace must be a device array \(ptxattn.empty"):
        ptxattn.decode(*decode_args(), workspace=np.zeros(1 << 20, np.uint8))
    with pytest.raises(TypeError, match="decode: workspace must be an array .* got str 'abc'"):
        ptxattn.decode(*decode_args(), workspace="abc")


def test_read_only_numpy_arrays_updated_in_place_are_refused():
    args = append_args()
    args[2].flags.writeable = False
    with pytest.raises(ValueError, match="kv_append: k_cache is updated in place but the NumPy array is read-only"):
        ptxattn.kv_append(*args)
    pool = ones(8, HKV, 16, D)
    pool.flags.writeable = False
    with pytest.raises(ValueError, match="paged_kv_append: k_pool is updated in place"):
        ptxattn.paged_kv_append(ones(3, HKV, D), ones(3, HKV, D), pool, ones(8, HKV, 16, D), np.arange(3))


@pytest.mark.parametrize("lens, match", [
    ([3, CAP + 1], rf"decode: seq_lens\[1\] = {CAP + 1} is outside \[0, {CAP}\]"),
    ([-1, 0], r"decode: seq_lens\[0\] = -1 is outside \[0, 128\]"),
])
def test_numpy_lengths_checked_on_the_host(lens, match):
    args = decode_args()
    args[3] = np.array(lens, np.int32)
    with pytest.raises(ValueError, match=match):
        ptxattn.decode(*args)


def test_numpy_append_position_checked_on_the_host():
    args = append_args()
    args[4] = np.array([CAP, 0], np.int32)  # appending one token there passes the capacity
    with pytest.raises(ValueError, match=rf"kv_append: seq_lens\[0\] = {CAP} is outside \[0, {CAP - 1}\]"):
        ptxattn.kv_append(*args)


def test_numpy_page_ids_checked_where_a_row_reads():
    args = paged_args()
    args[3][1, 3] = 8  # row 1 reads all 4 pages: one past the 8-page pool
    with pytest.raises(ValueError, match=r"paged_decode: block_table\[1\]\[3\] = 8 is outside \[0, 7\]"):
        ptxattn.paged_decode(*args)
    args[3][0, 3] = 99  # row 0 reads only its first page (3 keys): the rest is never read
    args[3][1, 3] = 7
    _validates(ptxattn.paged_decode, args)


def test_numpy_slots_checked_on_the_host():
    with pytest.raises(ValueError, match=r"paged_kv_append: slot_mapping\[2\] = 128 is outside \[-1, 127\]"):
        ptxattn.paged_kv_append(ones(3, HKV, D), ones(3, HKV, D), ones(8, HKV, 16, D), ones(8, HKV, 16, D),
                                np.array([0, -1, 128]))


@pytest.mark.parametrize("op, args", [(ptxattn.sdpa, lambda: [ones(1, 2, 3, D)] * 3), (ptxattn.decode, decode_args)])
def test_window_and_sinks_follow_one_rule(op, args):
    with pytest.raises(TypeError, match=rf"{op.__name__}: window must be None or a pair"):
        op(*args(), window=(1, 2, 3))
    with pytest.raises(TypeError, match=rf"{op.__name__}: window must be None or a pair"):
        op(*args(), window=(1.0, 0))
    with pytest.raises(ValueError, match=rf"{op.__name__}: window entries must be >= 0"):
        op(*args(), window=(-5, 0))
    heads = args()[0].shape[1]
    with pytest.raises(TypeError, match=rf"{op.__name__}: sinks must be float32 of shape \({heads},\)"):
        op(*args(), sinks=np.zeros(heads, np.float64))


def test_window_with_none_passes_validation_in_both():
    """(None, 0) means unbounded on the left in sdpa and decode alike (and the reference)."""
    _validates(ptxattn.sdpa, [ones(1, 2, 3, D)] * 3, window=(None, 0))
    _validates(ptxattn.decode, decode_args(), window=(None, 0))


def _validates(op, args, **options) -> None:
    """The op's own validation of a NumPy call accepts these arguments (no device needed)."""
    import inspect

    bound = inspect.signature(op).bind(*args, **options)
    bound.apply_defaults()
    spec = op.op
    spec.validate({n: bound.arguments[n] for n in spec.arrays}, *(bound.arguments[n] for n in spec.options),
                  on_host=True)
