"""Layouts, dtypes and the shared argument checks."""

import ml_dtypes
import numpy as np
import pytest

from pagedkv_np.errors import (
    ConfigError,
    DTypeError,
    LayoutError,
    PagedKVError,
    PageIdError,
    SequenceError,
    ShapeError,
)
from pagedkv_np.layout import (SUPPORTED_DTYPES, OutputLayout, StoreDims, StoreLayout,
    bits_view_dtype, check_array, resolve_dtype, store_shape)
from pagedkv_np.checks import (check_index, check_int, check_nonneg_int, check_positive_int,
    is_int, describe)


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


def test_layout_methods_add_no_members():
    assert [m.value for m in StoreLayout] == ["NHD", "HND"]
    assert [m.value for m in OutputLayout] == ["BTHD", "BHTD"]
    assert list(StoreLayout.__members__) == ["NHD", "HND"]
    assert list(OutputLayout.__members__) == ["BTHD", "BHTD"]


def test_store_layout_shape_puts_page_size_and_heads_on_their_axes():
    assert StoreLayout.NHD.shape(2, 10, 16, 4, 8) == (2, 10, 16, 4, 8)
    assert StoreLayout.HND.shape(2, 10, 16, 4, 8) == (2, 10, 4, 16, 8)
    for layout in StoreLayout:
        shape = layout.shape(2, 10, 16, 4, 8)
        assert shape[layout.offset_axis] == 16
        assert shape[layout.head_axis] == 4
        # The shape matches where an actual array puts a page's token offset.
        store = np.zeros(shape, np.float32)
        index = [1, 3, slice(None), slice(None), slice(None)]
        index[layout.offset_axis], index[layout.head_axis] = 5, 2
        store[tuple(index)] = 1.0
        if layout is StoreLayout.NHD:
            assert store[1, 3, 5, 2].all() and store.sum() == 8
        else:
            assert store[1, 3, 2, 5].all() and store.sum() == 8


def test_store_layout_axes():
    assert (StoreLayout.NHD.offset_axis, StoreLayout.NHD.head_axis) == (2, 3)
    assert (StoreLayout.HND.offset_axis, StoreLayout.HND.head_axis) == (3, 2)
    assert StoreLayout.parse("hnd").offset_axis == 3
    assert StoreLayout.parse("nhd").head_axis == 3


def test_store_layout_dims_inverts_shape():
    for layout in StoreLayout:
        dims = layout.dims(layout.shape(2, 10, 16, 4, 8))
        assert dims == StoreDims(2, 10, 16, 4, 8)
        assert (dims.num_layers, dims.num_pages, dims.page_size, dims.num_kv_heads,
                dims.head_dim) == (2, 10, 16, 4, 8)
    assert StoreLayout.HND.dims((2, 10, 4, 16, 8)).page_size == 16
    assert StoreLayout.NHD.dims(np.zeros((1, 2, 3, 4, 5)).shape).num_kv_heads == 4
    with pytest.raises(ShapeError, match=r"expected 5 dimensions, got \[1, 2, 3\]"):
        StoreLayout.NHD.dims((1, 2, 3))


def test_output_layout_shape_and_positions():
    assert OutputLayout.BTHD.shape(3, 7, 4, 8) == (3, 7, 4, 8)
    assert OutputLayout.BHTD.shape(3, 7, 4, 8) == (3, 4, 7, 8)
    assert (OutputLayout.BTHD.t_axis, OutputLayout.BHTD.t_axis) == (1, 2)
    assert OutputLayout.parse("bhtd").t_axis == 2
    for layout in OutputLayout:
        shape = layout.shape(3, 7, 4, 8)
        assert layout.num_positions(shape) == 7 == shape[layout.t_axis]
        assert layout.num_positions(np.zeros(shape).shape) == 7


@pytest.mark.parametrize("value, expected", [
    (0, True), (-3, True), (np.int64(2), True), (np.uint8(1), True), (2**70, True),
    (True, False), (False, False), (np.bool_(True), False), (1.0, False),
    (np.float32(1), False), ("1", False), (None, False)])
def test_is_int(value, expected):
    assert is_int(value) is expected


def test_check_int():
    assert check_int(-4, "n") == -4
    out = check_int(np.int32(5), "n")
    assert out == 5 and type(out) is int
    for bad, type_name in [(True, "bool"), (2.0, "float"), ("2", "str"), (None, "NoneType")]:
        with pytest.raises(DTypeError, match=f"^Invalid n: expected an integer, got {type_name}$"):
            check_int(bad, "n")


def test_check_index():
    assert check_index(0, "page_id", 4) == 0
    out = check_index(np.int64(3), "page_id", 4)
    assert out == 3 and type(out) is int
    for bad in (4, -1, 2**70):
        with pytest.raises(PageIdError) as info:
            check_index(bad, "page_id", 4)
        assert str(info.value).startswith("Invalid page_id: expected 0 <= page_id < 4, got ")
    with pytest.raises(PageIdError, match=r"got 4$"):
        check_index(4, "page_id", 4)
    with pytest.raises(PageIdError, match=r"got an integer of 71 bits$"):
        check_index(2**70, "page_id", 4)
    with pytest.raises(SequenceError, match=r"^Invalid slot: expected 0 <= slot < 2, got 2$"):
        check_index(2, "slot", 2, SequenceError)
    with pytest.raises(DTypeError, match="Invalid page_id: expected an integer, got bool"):
        check_index(True, "page_id", 4)
    with pytest.raises(PageIdError):
        check_index(0, "page_id", 0)


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
    with pytest.raises(DTypeError, match="Invalid n: expected an integer, got bool"):
        check_nonneg_int(False, "n")
    with pytest.raises(ConfigError, match="got an integer of 71 bits"):
        check_nonneg_int(-2**70, "n")


def test_describe():
    assert describe(np.zeros((2, 3), np.float16)) == "ndarray of shape [2, 3] and dtype float16"
    assert describe([1]) == "list"


def test_each_output_layout_names_the_store_layout_it_reads_in_runs():
    from pagedkv_np.layout import OutputLayout, StoreLayout
    assert OutputLayout.BTHD.store_layout is StoreLayout.NHD
    assert OutputLayout.BHTD.store_layout is StoreLayout.HND
    # a page of the matching store and a sequence's rows of the output share
    # their innermost axes order: (offset, head) for NHD/BTHD, (head, offset) for HND/BHTD
    for out in OutputLayout:
        store = out.store_layout
        assert (store.offset_axis < store.head_axis) == (out.t_axis == 1)


def test_store_dims_of_a_shape_seen_before_are_the_same_and_bad_shapes_still_fail():
    from pagedkv_np.errors import ShapeError
    from pagedkv_np.layout import StoreLayout
    for layout in StoreLayout:
        first = layout.dims((2, 8, 4, 3, 16))
        assert layout.dims((2, 8, 4, 3, 16)) == first == layout.dims([2, 8, 4, 3, 16])
        assert layout.shape(*first) == (2, 8, 4, 3, 16)
        with pytest.raises(ShapeError):
            layout.dims((2, 8, 4, 3))
    assert StoreLayout.NHD.dims((2, 8, 4, 3, 16)).page_size == 4
    assert StoreLayout.HND.dims((2, 8, 4, 3, 16)).page_size == 3
