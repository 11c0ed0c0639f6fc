"""Conversion and checking of token id sequences."""

import numpy as np
import pytest

from pagedkv_np.errors import DTypeError, ShapeError
from pagedkv_np.tokens import as_tokens


@pytest.mark.parametrize("tokens", [
    [1, 2, 3], (1, 2, 3), np.array([1, 2, 3], np.int32), np.array([1, 2, 3], np.uint16),
    [np.int64(1), 2, np.uint8(3)], range(1, 4), (t for t in (1, 2, 3)),
])
def test_as_tokens_accepts_integer_sequences(tokens):
    out = as_tokens(tokens)
    assert out.dtype == np.dtype("<i8") and out.ndim == 1 and out.flags.c_contiguous
    assert out.tolist() == [1, 2, 3]


def test_as_tokens_copies_strided_input_into_a_contiguous_array():
    base = np.arange(10, dtype=np.int64)
    out = as_tokens(base[::3])
    assert out.flags.c_contiguous and out.tolist() == [0, 3, 6, 9]


@pytest.mark.parametrize("n", [1, 64, 65, 1000])
def test_as_tokens_of_int64_arrays_of_any_length(n):
    ids = np.arange(n, dtype=np.int64)
    out = as_tokens(ids)
    assert out.dtype == np.dtype("<i8") and out.tolist() == ids.tolist()
    assert as_tokens(ids[::-1]).tolist() == ids[::-1].tolist()  # negative strides


def test_as_tokens_keeps_large_ids():
    big = np.iinfo(np.int64).max
    assert as_tokens([0, big]).tolist() == [0, big]
    assert as_tokens(np.array([big], np.uint64)).tolist() == [big]


@pytest.mark.parametrize("empty", [[], (), np.empty(0, np.int32), np.empty(0, np.float64)])
def test_as_tokens_empty(empty):
    out = as_tokens(empty)
    assert out.shape == (0,) and out.dtype == np.int64
    with pytest.raises(ShapeError, match="Invalid prompt: expected at least one token"):
        as_tokens(empty, "prompt", allow_empty=False)


@pytest.mark.parametrize("bad", [
    [1.0, 2.0], [1, 2.5], [True, 1], [1, "2"], [None], "123", b"12", None, 5, 3.0,
    np.array([1.0, 2.0]), np.array([True, False]), np.array(["1"]),
])
def test_as_tokens_rejects_non_integer_ids(bad):
    with pytest.raises(DTypeError, match=r"Invalid (dtype of )?prompt"):
        as_tokens(bad, "prompt")


@pytest.mark.parametrize("bad", [[1, -1], np.array([3, -2], np.int8), np.array([3, -2], np.int64),
                                 np.array([0] * 100 + [-1], np.int64)])
def test_as_tokens_rejects_negative_ids(bad):
    with pytest.raises(DTypeError, match="Invalid tokens: token ids must be >= 0"):
        as_tokens(bad)


@pytest.mark.parametrize("bad", [[2 ** 63], np.array([2 ** 63], np.uint64)])
def test_as_tokens_rejects_ids_past_int64(bad):
    with pytest.raises(DTypeError, match="does not fit in int64"):
        as_tokens(bad)


@pytest.mark.parametrize("bad", [np.zeros((2, 2), np.int64), np.array(5)])
def test_as_tokens_rejects_arrays_that_are_not_1d(bad):
    with pytest.raises(ShapeError, match="Invalid shape of tokens"):
        as_tokens(bad)


def test_as_tokens_rejects_nested_lists_with_a_shape_error():
    # The docstring promises ShapeError for nested input, as for a 2-D array.
    with pytest.raises(ShapeError, match="tokens"):
        as_tokens([[1, 2], [3, 4]])
