"""Malformed calls to custom_kernel raise TypeError/ValueError naming the argument, before any GPU work.
These run on the CPU: dtype, shape and layout checks come before the device check."""

import pytest
import torch

import inputs
import submission


def good(m=256, k=512, l=2):
    return list(inputs.random_inputs(m, k, l, seed=1, device="cpu"))


def raises(data, exc, *words):
    with pytest.raises(exc) as info:
        submission.custom_kernel(tuple(data) if isinstance(data, list) else data)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_wrong_tuple_length():
    raises(good()[:6], TypeError, "'data'", "7 tensors", "length 6")


def test_not_a_tuple():
    raises(torch.zeros(3), TypeError, "'data'")


@pytest.mark.parametrize("idx,name", list(enumerate(submission._NAMES)))
def test_each_tensor_with_wrong_dtype(idx, name):
    d = good()
    d[idx] = d[idx].view(torch.uint8) if d[idx].dtype != torch.float16 else d[idx].float()
    raises(d, TypeError, f"'{name}'", "dtype")


def test_non_tensor_argument():
    d = good()
    d[3] = [1, 2, 3]
    raises(d, TypeError, "'sfb'", "torch.Tensor")


SLICED = [  # (what is wrong, index in data, the slice that makes it so, words the error must contain)
    ("m_not_multiple_of_128", 0, (slice(0, 200),), ("'a'", "multiple of 128", "200")),
    ("k_not_multiple_of_64", 0, (slice(None), slice(0, 48)), ("'a'", "multiple of 64", "96")),
    ("b_with_mismatched_k", 1, (slice(None), slice(0, 128)), ("'b'", "shape")),
    ("b_not_padded_to_128_rows", 1, (slice(0, 1),), ("'b'", "(128, 256, 2)", "(1, 256, 2)")),
    ("c_with_mismatched_l", 6, (slice(None), slice(None), slice(0, 1)), ("'c'", "shape")),
]


@pytest.mark.parametrize("idx,cut,words", [pytest.param(*c[1:], id=c[0]) for c in SLICED])
def test_sliced_tensor_is_named(idx, cut, words):
    d = good()
    d[idx] = d[idx][cut]
    raises(d, ValueError, *words)


@pytest.mark.parametrize("idx,name,cut", [(2, "sfa", (slice(None), slice(0, 16))), (3, "sfb", (slice(0, 1),)),
                                          (4, "sfa_permuted", (slice(0, 16),)),
                                          (5, "sfb_permuted", (Ellipsis, slice(0, 1)))])
def test_scales_of_wrong_shape(idx, name, cut):
    d = good()
    d[idx] = d[idx][cut]
    raises(d, ValueError, f"'{name}'", "shape")


def test_a_not_k_contiguous():
    d = good()
    a = d[0]
    d[0] = a.view(torch.uint8).transpose(0, 1).contiguous().transpose(0, 1).view(torch.float4_e2m1fn_x2)
    raises(d, ValueError, "'a'", "K-contiguous")


def test_a_misaligned_rows():
    d = good()
    u = torch.zeros(256 * 264 * 2, dtype=torch.uint8)
    d[0] = u.as_strided((256, 256, 2), (264, 1, 256 * 264)).view(torch.float4_e2m1fn_x2)
    raises(d, ValueError, "'a'", "16-byte")


def test_c_expanded_is_not_writable():
    d = good()
    d[6] = torch.zeros(256, 1, 1, dtype=torch.float16).expand(256, 1, 2)
    raises(d, ValueError, "'c'", "writable")


def test_cpu_tensors_rejected():
    raises(good(), ValueError, "'a'", "CUDA tensor", "cpu")


def test_k_above_supported_maximum():
    d = good(128, submission.MAX_K + 64, 1)
    raises(d, ValueError, "'a'", f"K <= {submission.MAX_K}")


def column_major(t):
    u = t.view(torch.uint8)
    return u.transpose(0, 1).contiguous().transpose(0, 1).view(t.dtype)


LAYOUT = [  # (what is wrong, index in data, how, words the error must contain)
    ("b_not_k_contiguous", 1, column_major, ("'b'", "K-contiguous")),
    ("b_misaligned", 1, lambda t: inputs.misaligned(t, 8), ("'b'", "16-byte")),
    ("sfa_not_k_contiguous", 2, column_major, ("'sfa'", "K-contiguous scales")),
    ("sfb_not_k_contiguous", 3, column_major, ("'sfb'", "K-contiguous scales")),
    ("sfa_odd_address", 2, lambda t: inputs.misaligned(t, 1), ("'sfa'", "K-contiguous scales")),
]


@pytest.mark.parametrize("idx,how,words", [pytest.param(*c[1:], id=c[0]) for c in LAYOUT])
def test_layout_the_kernel_cannot_read_is_named(idx, how, words):
    d = good()
    d[idx] = how(d[idx])
    raises(d, ValueError, *words)


@pytest.mark.parametrize("idx,name", [(4, "sfa_permuted"), (5, "sfb_permuted")])
def test_permuted_scales_in_another_layout_are_named(idx, name):
    """Where the plain scales are elsewhere (the meta device stands in for 'not where a is'), the permuted
    ones are read, and must have the generator's layout."""
    d = good()
    d[2], d[3] = d[2].to("meta"), d[3].to("meta")
    d[idx] = d[idx].contiguous()  # the generator's are a permuted view, not contiguous
    raises(d, ValueError, f"'{name}'", "the generator's layout")


def test_empty_batch_is_named():
    d = good()
    d = [t[..., :0] for t in d]
    raises(d, ValueError, "'a'", "L (dim 2) >= 1")


def test_changed_metadata_of_the_same_tensor_objects_gives_a_new_plan_key():
    """The launch-plan cache is keyed by metadata read on every call: ``t.data = view`` keeps the Python
    object (and its version counter) but changes strides, so the key changes and the call is validated
    afresh (here: rejected, as the new layout is not K-contiguous)."""
    d = good()
    key = submission._metadata(tuple(d))
    a = d[0]
    a.data = column_major(a)
    assert submission._metadata(tuple(d)) != key
    raises(d, ValueError, "'a'", "K-contiguous")
