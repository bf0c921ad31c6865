"""What a compiled decode step costs the host in dynamo guards (issue "Tokens, not kernels": within 10% of
bf16's). Every guard is evaluated on every call of the compiled model, so a layer's state read while
tracing (its mode, a fused group's bookkeeping, a type check in the op's entry) is paid once a token.
Counted on a 2-layer Llama of small dims by ``tools/guard_count.py`` (layer 1's guards, so that the count
is a layer's whatever the model's depth)."""

import pytest

pytest.importorskip("transformers")

from tools import guard_count  # noqa: E402


@pytest.fixture(scope="module")
def bf16():
    return guard_count.measure("bf16", layers=2, calls=1, device="cpu", per_layer=True)


@pytest.mark.parametrize("variant", ["w4a16", "w4a16-fused", "w4a16-fused-packed"])
def test_a_layer_of_ours_costs_at_most_a_tenth_more_guards_than_bf16s(bf16, variant):
    ours = guard_count.measure(variant, layers=2, calls=1, device="cpu", per_layer=True)
    assert ours["graphs"] == 1 and ours["graph_breaks"] == 0
    assert ours["layer_guards"] <= 1.10 * bf16["layer_guards"], (ours["per_layer"], bf16["per_layer"])


def test_a_fused_groups_non_owner_parts_cost_no_more_guards_than_a_bf16_linear(bf16):
    # the group's state is read through its owner (the first part): the others hold only their path
    ours = guard_count.measure("w4a16-fused-packed", layers=2, calls=1, device="cpu", per_layer=True)
    for part in ("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
        assert ours["per_layer"][part] <= bf16["per_layer"][part]
