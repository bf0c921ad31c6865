"""The per-shape kernel configuration: which problems take the latency config, which the bulk-copy
kernel, and that every configuration the heuristic can pick is a valid kernel (chunks split evenly or,
in the split-row kernel, with the last chunk of some lanes past the row; shared memory within the SM's)."""

import importlib.metadata

import cutlass
import pytest

import submission
from conftest import task_cases

G = submission.Nvfp4Gemv
LATENCY = submission.latency_tuning  # None where the problem does not fit one wave
H200_SMS = 132


ONE_WAVE = [c for c in task_cases("tests") if c[:3] != (2432, 4608, 2)]


@pytest.mark.parametrize("m,k,l,seed", ONE_WAVE)
def test_small_test_shapes_take_the_latency_config(m, k, l, seed):
    tuning = LATENCY(k, m, l, H200_SMS)
    assert tuning is not None
    op = G(k, False, **dict(tuning))
    assert op.per_lane == op.batch, "one unit a row: the lane's loads all in flight at once"


@pytest.mark.parametrize("m,k,l,seed", task_cases("benchmarks") + [(2432, 4608, 2, 0)])
def test_shapes_beyond_one_wave_stream(m, k, l, seed):
    assert LATENCY(k, m, l, H200_SMS) is None


@pytest.mark.parametrize("m,k,l,seed", task_cases("benchmarks"))
def test_long_rows_beyond_one_wave_take_the_bulk_kernel(m, k, l, seed):
    assert bool(dict(submission.pick_tuning(k, m, l, H200_SMS, False)).get("bulk")) == (k >= submission.BULK_MIN_K)
    assert submission.pick_tuning(k, m, l, H200_SMS, True) == submission.Streaming(), "blocked scales: streaming kernel"


@pytest.mark.parametrize("m,k,l,batch,ctas", [(7168, 2048, 4, 4, 3), (16384, 2048, 1, 4, 3), (4096, 2048, 8, 4, 3),
                                               (8192, 1024, 2, 4, 3 if submission.DSL_VERSION < (4, 4) else None),
                                               (4096, 4096, 4, 4, 3), (16384, 4096, 1, 4, 3), (2048, 6144, 2, 4, 3),
                                               (8192, 6144, 2, 4, 3), (4096, 5120, 4, 2, None),
                                               (4096, 3072, 4, 2, None)])
def test_streaming_units_of_4_or_2_chunks_load_scales_wide(m, k, l, batch, ctas):
    """Measured on H200 (docs/history/perf-notes.md): two-byte scale loads cost the streaming kernel more than their
    bytes; units of 4 chunks then run 3 CTAs a SM (4 spill on DSL 4.8), but for K = 1024 on DSL 4.4+. Where a
    lane's share of the row divides in fours (K = 4096, 6144) its units hold 4 chunks (a row's scales in 128-byte
    pieces, not 64: 0.35-1.0 us faster on 8 of 9 shapes, 16384x4096x1 mixed); elsewhere (K = 3072, 5120) 2."""
    tuning = dict(submission.pick_tuning(k, m, l, H200_SMS, False))
    assert tuning.get("sf_wide") == 1 and tuning.get("min_blocks") == ctas
    op = submission.make_op(k, False, **tuning)
    assert op.batch == batch
    assert submission.pick_tuning(k, m, l, H200_SMS, True) == submission.Streaming(), "blocked scales: two-byte loads"


@pytest.mark.parametrize("k", [26624, 30720, 53248])
def test_long_rows_without_the_bulk_kernel_keep_units_of_2_chunks(k):
    """Units of 4 were measured only below the bulk kernel's K; longer rows that it does not split evenly stay as
    they were (not measured)."""
    assert not submission.bulk_suits(k) and G(k, False).batch == 2
    assert dict(submission.pick_tuning(k, 8192, 4, H200_SMS, False)) == {"sf_wide": 1}


def test_dsl_version_names_the_installed_dsl():
    """The K = 1024 rule below keys on it; a version not read ((0, 0)) would route DSL 4.4+ like 4.3."""
    installed = getattr(cutlass, "__version__", None) or importlib.metadata.version("nvidia-cutlass-dsl")
    assert submission.DSL_VERSION == tuple(int(v) for v in installed.split(".")[:2])
    assert submission.DSL_VERSION >= (4, 3)


@pytest.mark.parametrize("dsl,ctas", [((4, 3), 3), ((4, 4), 2), ((4, 8), 2), ((5, 0), 2)])
def test_units_of_4_chunks_over_8_lanes_run_2_ctas_from_dsl_4_4(dsl, ctas):
    """K = 1024 with wide scale loads on H200: 3 CTAs a SM 0.4 us faster than 2 on DSL 4.3.5, 0.4-1.4 us
    slower on 4.8.1 (nearly the same SASS, ordered differently); K = 2048 (16 lanes) keeps 3 on both."""
    assert G(1024, False, **dict(submission.wide_tuning(1024, dsl=dsl))).ctas_per_sm() == ctas
    assert G(2048, False, **dict(submission.wide_tuning(2048, dsl=dsl))).ctas_per_sm() == 3


@pytest.mark.parametrize("m,k,l", [(2432, 4608, 2), (2048, 2304, 3), (8192, 1280, 4), (2048, 1536, 4)])
def test_unit_shapes_not_measured_faster_keep_two_byte_scale_loads(m, k, l):
    """Units of 3 chunks (K = 4608: no gain measured), of 1 chunk, or of 2 chunks over 8 lanes (not measured)."""
    assert submission.pick_tuning(k, m, l, H200_SMS, False) == submission.Streaming()


@pytest.mark.parametrize("k", [4160, 2112, 1088])
def test_rows_split_over_fewer_than_8_lanes_keep_two_byte_scale_loads(k):
    """K % 256 != 0 (sfa rows not a multiple of 16 bytes) always means fewer than 8 lanes a row here."""
    assert G(k, False).group < 8
    assert submission.wide_tuning(k) is None
    assert submission.pick_tuning(k, 8192, 4, H200_SMS, False) == submission.Streaming()


@pytest.mark.parametrize("l", range(1, 17))
@pytest.mark.parametrize("ctas", [2, 3, 4])
def test_streaming_grid_fits_one_wave(l, ctas):
    """Rounded down: a CTA past the SMs' slots would run alone in a second wave (2 us at 4096x2048x8)."""
    op = G(2048, False, min_blocks=ctas)
    assert op.ctas_per_sm() == ctas
    assert op.grid_x(16384, l, H200_SMS) * l <= H200_SMS * ctas


@pytest.mark.parametrize("m,k,l", [(2048, 11264, 1), (1024, 12288, 2), (512, 9216, 4)])
def test_one_wave_long_rows_too_many_to_split_take_the_bulk_kernel(m, k, l):
    """Measured on H200: the bulk kernel 0.8-2.1 us faster than the latency config on these."""
    assert dict(LATENCY(k, m, l, H200_SMS)).get("batch") == k // 32 // 32, "latency config possible"
    assert dict(submission.pick_tuning(k, m, l, H200_SMS, False)).get("bulk") == 1
    assert submission.pick_tuning(k, m, l, H200_SMS, True) == LATENCY(k, m, l, H200_SMS), "blocked scales"


@pytest.mark.parametrize("m,k,l,dynamic", [(4096, 7168, 8, True), (2048, 11264, 1, True), (1024, 8192, 4, True),
                                           (7168, 16384, 1, False), (1024, 12288, 2, False)])
def test_bulk_tiles_of_several_rows_are_claimed_at_run_time(m, k, l, dynamic):
    """Dynamic tiles measured faster on 4-row tiles (K = 7168) and slower on one-row tiles (K = 16384)."""
    tuning = submission.pick_tuning(k, m, l, H200_SMS, False)
    assert (tuning == submission.Bulk(dynamic=1)) == dynamic, tuning
    assert (tuple(tuning) == (("bulk", 1), ("dynamic", 1))) == dynamic, "its (name, value) pairs"
    assert (submission.make_op(k, False, **dict(tuning)).rows >= 2) == dynamic


@pytest.mark.parametrize("m,k,l,split", [(1024, 7168, 1, 4), (512, 7168, 2, 4), (1536, 7168, 1, 2),
                                         (2048, 7168, 1, 2), (1024, 7168, 2, 2), (768, 11264, 1, 4)])
def test_one_wave_long_rows_split_with_a_tail_at_several_chunks_a_lane(m, k, l, split):
    """K >= 7168: up to four chunks a lane with the last one past the row for some lanes (at least 85%
    inside), where the split does not divide the row; measured faster than the bulk kernel on these."""
    tuning = dict(submission.pick_tuning(k, m, l, H200_SMS, False))
    op = submission.make_op(k, False, **tuning)
    assert isinstance(op, submission.Nvfp4GemvSplit) and op.split == split and op.tail and op.per_lane > 1
    assert m * l * op.row_lanes <= H200_SMS * 1024, "every thread resident at once"
    assert submission.pick_tuning(k, m, l, H200_SMS, True) == LATENCY(k, m, l, H200_SMS), (
        "blocked scales (no bulk kernel to beat): the latency config, as before")


@pytest.mark.parametrize("m,k,l,rows", [
    (768, 11264, 1, 2), (1536, 7168, 1, 4), (128, 1536, 1, 4),  # 256 threads: fewer on the busiest SM
    (512, 1536, 2, 8), (512, 4096, 2, 4), (2048, 7168, 1, 8),  # a tie: 512 threads
    (384, 7168, 2, 2),  # split 7: 256 threads would be one-row CTAs
    (128, 7232, 1, 2), (128, 7168, 3, 2),  # one-row CTAs would load the busiest SM less: +0.16 us measured
])
def test_split_ctas_of_256_threads_only_where_they_load_the_busiest_sm_less(m, k, l, rows):
    """768x11264x1: 192 CTAs of 512 threads give 60 SMs two (1024 threads), 384 of 256 give none more
    than three (768): 7.20 -> 6.72 us on H200; where both load it alike, 512 (measured 0.05-0.15 faster)."""
    assert dict(submission.pick_tuning(k, m, l, H200_SMS, False))["rows"] == rows


@pytest.mark.parametrize("k", range(1088, submission.MAX_K + 1, 64))
@pytest.mark.parametrize("m,l", [(128, 1), (128, 3), (256, 2), (384, 4), (768, 1), (1024, 2), (2048, 1)])
def test_split_ctas_fit_the_occupancy_they_ask_for(k, m, l):
    tuning = dict(submission.pick_tuning(k, m, l, H200_SMS, False))
    if "split" in tuning:
        op = submission.make_op(k, False, **tuning)
        assert op.min_blocks * op.threads <= (1536 if op.per_lane == 1 else 1024)


@pytest.mark.parametrize("m,k,l,split,one_wave", [
    (128, 22528, 3, 8, True),  # split 11: 3 CTAs of 352 threads a SM needed, 2 allowed (7.52 us; 8: 7.26)
    (128, 12288, 5, 4, True),  # split 6 likewise (6.98 us; 4: 6.85)
    (384, 4160, 3, 5, False),  # no split fits one wave; two waves (5.89 us) beat streaming (38.5)
    (384, 7168, 2, 7, True),
])
def test_split_takes_the_largest_that_fits_one_wave_else_two_waves(m, k, l, split, one_wave):
    tuning = dict(submission.pick_tuning(k, m, l, H200_SMS, False))
    op = submission.make_op(k, False, **tuning)
    assert op.split == split
    assert (op.grid_x(m, l, H200_SMS) * l <= op.min_blocks * H200_SMS) == one_wave


@pytest.mark.parametrize("m,k,l,latency", [
    (2048, 4608, 2, False), (1536, 4608, 2, False), (1024, 4608, 4, False), (4096, 2304, 2, False),
    (1024, 4608, 2, True), (2048, 2304, 2, True), (3072, 2304, 1, True),  # no more CTAs than SMs
    (4096, 1280, 2, True), (4096, 3584, 1, True),  # 5 and 7 chunks a lane
    (2048, 2816, 4, True), (3072, 5632, 1, True),  # 11 chunks a lane, streaming units of 1 chunk
])
def test_latency_config_yields_to_streaming_where_its_tail_is_longer(m, k, l, latency):
    """One unit of 8+ chunks a lane on more CTAs than SMs computes everything after its last byte; the
    streaming kernel overlaps its units of 3+ chunks (measured on H200, docs/history/perf-notes.md)."""
    assert (LATENCY(k, m, l, H200_SMS) is not None) == latency
    assert submission.pick_tuning(k, m, l, H200_SMS, False) == (LATENCY(k, m, l, H200_SMS) or submission.Streaming())


@pytest.mark.parametrize("m,k,l,seed", ONE_WAVE)
def test_one_wave_splits_rows_over_warps_where_k_allows(m, k, l, seed):
    tuning = submission.pick_tuning(k, m, l, H200_SMS, False)
    if k > 1024:  # two warps' chunks or more; where 1024 does not divide K the last warp is partly idle
        op = submission.make_op(k, False, **dict(tuning))
        assert isinstance(op, submission.Nvfp4GemvSplit) and op.per_lane == 1, "one chunk a lane"
        assert m * l * op.row_lanes <= H200_SMS * 1536, "every thread resident at once"
    else:
        assert tuning == LATENCY(k, m, l, H200_SMS)


@pytest.mark.parametrize("k", range(64, submission.MAX_K + 1, 64))
def test_every_k_gets_a_valid_config(k):
    for m, l in ((128, 1), (256, 2), (1024, 1), (4096, 8)):
        for sms in (132, 148):
            for blocked in (False, True):
                tuning = dict(submission.pick_tuning(k, m, l, sms, blocked))
                op = submission.make_op(k, blocked, **tuning)
                if tuning.get("split"):
                    assert (op.per_lane - 1) * op.row_lanes < op.chunks <= op.per_lane * op.row_lanes
                    assert 1 <= op.per_lane <= 4 and (op.per_lane == 1 or not op.tail or (
                        not blocked and submission.bulk_suits(k) and op.split in (2, 4, 8, 16)))
                    assert op.threads <= 1024 and op.grid_x(m, l, sms) * op.rows_per_cta >= m
                    continue
                if tuning.get("bulk"):
                    assert op.tr * op.n == op.chunks and op.n <= 12 and 128 % op.rows == 0
                    assert (op.smem_bytes + 1024) * op.ctas <= 233472 and op.grid_x(m, l, sms) >= 1
                    continue
                assert op.group * op.per_lane == op.chunks and op.per_lane % op.batch == 0
                assert op.threads % op.group == 0 and 32 % op.group == 0


def test_bulk_kernel_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="K % 256"):
        submission.Nvfp4GemvBulk(7232, False)
    with pytest.raises(ValueError, match="plain scales"):
        submission.Nvfp4GemvBulk(7168, True)
    with pytest.raises(ValueError, match="shared memory"):
        submission.Nvfp4GemvBulk(32768, False, stages=8, ctas=2)


def test_split_kernel_rejects_rows_it_cannot_split():
    with pytest.raises(ValueError, match="split 7"):
        submission.Nvfp4GemvSplit(4096, False, split=7)
    with pytest.raises(ValueError, match="K=1536"):
        submission.Nvfp4GemvSplit(1536, False, split=3)
    with pytest.raises(ValueError, match="2..32 warps"):
        submission.Nvfp4GemvSplit(2048, False, split=1)


@pytest.mark.parametrize("k,split,per_lane", [(1536, 2, 1), (4608, 3, 2), (4608, 5, 1), (7168, 2, 4), (2048, 2, 1)])
def test_split_kernel_takes_rows_with_a_tail(k, split, per_lane):
    op = submission.Nvfp4GemvSplit(k, False, split=split)
    assert op.per_lane == per_lane
    assert op.tail == (k // 32 % (32 * split) != 0)


def test_bad_tuning_is_rejected():
    with pytest.raises(ValueError, match="K=7168"):
        G(7168, False, group=64)
    with pytest.raises(ValueError, match="K=4608"):
        G(4608, False, batch=4)


@pytest.mark.parametrize("k", range(64, submission.MAX_K + 1, 448))
def test_a_configuration_is_its_sorted_pairs(k):
    """tuning.py's configurations are the kernels' keyword arguments: one iterates as the (name, value) pairs it
    sets, sorted (the bulk kernel's with its selector), and ``as_config`` reads it back from them."""
    for m, l in ((128, 1), (4096, 8)):
        for blocked in (False, True):
            config = submission.pick_tuning(k, m, l, H200_SMS, blocked)
            pairs = tuple(config)
            assert pairs == tuple(sorted(pairs)) and submission.as_config(pairs) == config
            assert submission.as_config(dict(pairs)) == config and submission.as_config(config) is config
            assert config.sfa_rows_16() == bool(dict(pairs).get("bulk") or dict(pairs).get("sf_wide"))


def test_configurations_name_their_kernel():
    assert tuple(submission.Streaming()) == () and submission.Streaming().kernel is G
    assert tuple(submission.Bulk(dynamic=1)) == (("bulk", 1), ("dynamic", 1))
    assert tuple(submission.Split(split=2, rows=1, min_blocks=4)) == (("min_blocks", 4), ("rows", 1), ("split", 2))
    assert type(submission.make_op(7168, False, bulk=1)) is submission.Nvfp4GemvBulk
    assert type(submission.make_op(7168, False, split=7)) is submission.Nvfp4GemvSplit
    with pytest.raises(TypeError):
        submission.as_config((("groups", 4),))  # no such knob of the streaming kernel
