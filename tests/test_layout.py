"""Layouts, dtypes and the shared argument checks."""

import ml_dtypes
import numpy as np
import pytest

from pagedkv_np.errors import ConfigError, DTypeError, LayoutError, PagedKVError, ShapeError
from pagedkv_np.layout import (
    SUPPORTED_DTYPES,
    OutputLayout,
    StoreLayout,
    bits_view_dtype,
    check_array,
    check_nonneg_int,
    check_positive_int,
    describe,
    resolve_dtype,
    store_shape,
)


@pytest.mark.parametrize("value, expected", [
    ("NHD", StoreLayout.NHD), ("hnd", StoreLayout.HND), ("Nhd", StoreLayout.NHD),
    (StoreLayout.HND, StoreLayout.HND),
])
def test_store_layout_parse(value, expected):
    assert StoreLayout.parse(value) is expected


@pytest.mark.parametrize("value, expected", [
    ("BTHD", OutputLayout.BTHD), ("bhtd", OutputLayout.BHTD),
    (OutputLayout.BTHD, OutputLayout.BTHD),
])
def test_output_layout_parse(value, expected):
    assert OutputLayout.parse(value) is expected


@pytest.mark.parametrize("bad", ["NDH", "", None, 3, "BTHD"])
def test_store_layout_parse_rejects_with_the_argument_name(bad):
    with pytest.raises(LayoutError, match="my_layout"):
        StoreLayout.parse(bad, "my_layout")


@pytest.mark.parametrize("bad", ["THBD", "NHD", None, 0])
def test_output_layout_parse_rejects_with_the_argument_name(bad):
    with pytest.raises(LayoutError, match="out_layout"):
        OutputLayout.parse(bad, "out_layout")


def test_layout_error_is_a_value_error():
    assert issubclass(LayoutError, ValueError) and issubclass(LayoutError, PagedKVError)


@pytest.mark.parametrize("value, name", [
    ("float32", "float32"), ("FLOAT16", "float16"), ("bfloat16", "bfloat16"),
    (np.float32, "float32"), (np.dtype(np.float16), "float16"), (ml_dtypes.bfloat16, "bfloat16"),
    (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
])
def test_resolve_dtype_accepts_names_types_and_dtypes(value, name):
    assert resolve_dtype(value) == SUPPORTED_DTYPES[name]
    assert resolve_dtype(value).name == name


@pytest.mark.parametrize("bad", ["float64", np.float64, np.int32, "int8", None, object(), "f4x"])
def test_resolve_dtype_rejects_unsupported(bad):
    with pytest.raises(DTypeError, match="cache_dtype"):
        resolve_dtype(bad, "cache_dtype")


@pytest.mark.parametrize("dtype, bits", [
    ("float32", np.uint32), ("float16", np.uint16), ("bfloat16", np.uint16)])
def test_bits_view_dtype_has_the_same_width(dtype, bits):
    dt = resolve_dtype(dtype)
    assert bits_view_dtype(dt) == np.dtype(bits)
    x = np.array([-0.0, 1.5, np.nan], dtype=dt)
    assert x.view(bits_view_dtype(dt)).shape == x.shape


def test_store_shape_nhd_and_hnd():
    assert store_shape(StoreLayout.NHD, 2, 10, 16, 4, 8) == (2, 10, 16, 4, 8)
    assert store_shape("HND", 2, 10, 16, 4, 8) == (2, 10, 4, 16, 8)
    with pytest.raises(LayoutError):
        store_shape("XYZ", 2, 10, 16, 4, 8)


def test_check_array_accepts_a_matching_array():
    x = np.zeros((3, 4), np.float32)
    assert check_array(x, "x", shape=(3, None), dtype=np.dtype(np.float32),
                       contiguous=True, writeable=True) is None


def test_check_array_rejects_non_arrays():
    with pytest.raises(DTypeError, match="Invalid foo: expected an array, got list"):
        check_array([1, 2], "foo")


def test_check_array_shape_message_names_argument_and_shapes():
    with pytest.raises(ShapeError, match=r"Invalid shape of k: expected \[3, \*\], got \[2, 4\]"):
        check_array(np.zeros((2, 4)), "k", shape=(3, None))
    with pytest.raises(ShapeError, match=r"Invalid shape of k: expected \[3, \*\], got \[3\]"):
        check_array(np.zeros(3), "k", shape=(3, None))


def test_check_array_ndim():
    with pytest.raises(ShapeError, match="Invalid shape of t: expected 2 dimensions"):
        check_array(np.zeros(3), "t", ndim=2)


def test_check_array_dtype():
    with pytest.raises(DTypeError, match="Invalid dtype of v: expected float16, got float32"):
        check_array(np.zeros(3, np.float32), "v", dtype=np.dtype(np.float16))


def test_check_array_contiguous_and_writeable():
    x = np.zeros((4, 4), np.float32)
    with pytest.raises(ShapeError, match="Invalid strides of out"):
        check_array(x[:, ::2], "out", contiguous=True)
    x.setflags(write=False)
    with pytest.raises(ShapeError, match="Invalid out: the array is read-only"):
        check_array(x, "out", writeable=True)


def test_check_array_custom_array_type():
    with pytest.raises(DTypeError, match="Invalid x"):
        check_array(np.zeros(2), "x", array_type=(list,))


@pytest.mark.parametrize("value", [1, 7, np.int64(3), np.uint8(2)])
def test_check_positive_int_accepts(value):
    out = check_positive_int(value, "n")
    assert out == int(value) and type(out) is int


@pytest.mark.parametrize("value, error", [
    (0, ConfigError), (-1, ConfigError), (True, DTypeError), (1.0, DTypeError),
    ("3", DTypeError), (None, DTypeError)])
def test_check_positive_int_rejects(value, error):
    with pytest.raises(error, match="num_widgets"):
        check_positive_int(value, "num_widgets")


def test_check_nonneg_int():
    assert check_nonneg_int(0, "n") == 0
    assert check_nonneg_int(np.int32(5), "n") == 5
    with pytest.raises(ConfigError, match="Invalid n: expected an integer >= 0, got -1"):
        check_nonneg_int(-1, "n")
    with pytest.raises(DTypeError, match="Invalid n"):
        check_nonneg_int(False, "n")


def test_describe():
    assert describe(np.zeros((2, 3), np.float16)) == "ndarray of shape [2, 3] and dtype float16"
    assert describe([1]) == "list"
