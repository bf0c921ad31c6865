"""custom_kernel behaves like a torch op: special values as the reference, CUDA graphs, threads, other
devices, steady memory."""

import threading

import pytest
import torch

import inputs
import submission

pytestmark = pytest.mark.gpu


def check(data, out):
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg


KERNELS = {"registers": submission.Nvfp4Gemv, "split": submission.Nvfp4GemvSplit, "bulk": submission.Nvfp4GemvBulk}


def takes_kernel(m, k, l, kernel):
    """The shape goes where the test means it to go."""
    tuning = submission.pick_tuning(k, m, l, torch.cuda.get_device_properties(0).multi_processor_count, False)
    assert type(submission.make_op(k, False, **dict(tuning))) is KERNELS[kernel]


# one shape for each kernel class
EACH_KERNEL = pytest.mark.parametrize("kernel", sorted(KERNELS))


@EACH_KERNEL
def test_nan_scales_give_nan_rows_like_the_reference(kernel):
    m, k, l = {"registers": (256, 1024, 2), "split": (384, 7168, 2), "bulk": (2048, 7168, 2)}[kernel]
    takes_kernel(m, k, l, kernel)
    data = inputs.random_inputs(m, k, l, seed=21)
    sfa = data[2].view(torch.uint8).clone()
    sfa[5, 3, 0] = 0x7F  # e4m3fn NaN
    sfa[9, 0, 1] = 0xFF  # negative NaN
    sfb = data[3].view(torch.uint8).clone()
    sfb[0, 7, 1] = 0x7F  # poisons every row of batch 1
    data = (data[0], data[1], sfa.view(torch.float8_e4m3fn), sfb.view(torch.float8_e4m3fn),
            inputs.permute_scales(sfa.view(torch.float8_e4m3fn)), inputs.permute_scales(sfb.view(torch.float8_e4m3fn)),
            data[6])
    out = submission.custom_kernel(inputs.poisoned(data))
    want = inputs.expected(data)
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    assert torch.isnan(out[5, 0, 0]) and torch.isnan(out[:, 0, 1]).all() and not torch.isnan(out[6, 0, 0])
    check(data, out)


def test_all_zero_inputs_give_zeros():
    data = inputs.random_inputs(128, 512, 2, seed=2)
    a = torch.zeros_like(data[0].view(torch.uint8)).view(torch.float4_e2m1fn_x2)
    out = submission.custom_kernel(inputs.poisoned((a, *data[1:])))
    assert torch.equal(out, torch.zeros_like(out))


@EACH_KERNEL
def test_fp16_overflow_gives_inf_like_the_reference(kernel):
    m, k = {"registers": (128, 1024), "split": (128, 4096), "bulk": (4096, 8192)}[kernel]
    takes_kernel(m, k, 1, kernel)
    a = torch.full((m, k // 2, 1), 0x77, dtype=torch.uint8, device="cuda")  # +6, +6
    a[1::2] = 0xFF  # -6, -6
    big = torch.full((m, k // 16, 1), 448.0, device="cuda").to(torch.float8_e4m3fn)
    bigb = torch.full((128, k // 16, 1), 448.0, device="cuda").to(torch.float8_e4m3fn)
    data = (a.view(torch.float4_e2m1fn_x2), a[:128].clone().view(torch.float4_e2m1fn_x2), big, bigb,
            inputs.permute_scales(big), inputs.permute_scales(bigb), torch.zeros(m, 1, 1, dtype=torch.float16, device="cuda"))
    out = submission.custom_kernel(inputs.poisoned(data))
    want = inputs.expected(data)
    assert torch.isposinf(want[0, 0, 0]) and torch.isneginf(want[1, 0, 0])
    check(data, out)


@EACH_KERNEL
def test_cuda_graph_capture_and_replay_with_new_data(kernel):
    m, k, l = {"registers": (1024, 1024, 3), "split": (512, 2048, 3), "bulk": (1024, 16384, 2)}[kernel]
    takes_kernel(m, k, l, kernel)
    first = inputs.random_inputs(m, k, l, seed=1)
    static = [t.clone() for t in first]
    submission.custom_kernel(tuple(static))  # compile and warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        submission.custom_kernel(tuple(static))
    for seed in (2, 3):
        fresh = inputs.random_inputs(m, k, l, seed=seed)
        for dst, src in zip(static[:6], fresh[:6]):
            dst.copy_(src)
        static[6].fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(fresh, static[6])


def test_threads_on_their_own_streams_get_every_result_right():
    """Three threads, one kernel class each, 20 calls a thread on fresh data, each output checked."""
    shapes = {"registers": (2048, 1024, 2), "split": (384, 7168, 2), "bulk": (2048, 7168, 2)}
    for kernel, (m, k, l) in shapes.items():
        takes_kernel(m, k, l, kernel)
    cases = {kernel: [inputs.random_inputs(*shape, seed=100 + j) for j in range(20)] for kernel, shape in shapes.items()}
    outs, errors = {kernel: [] for kernel in shapes}, []

    def work(kernel):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for data in cases[kernel]:
                    outs[kernel].append(submission.custom_kernel(inputs.poisoned(data)))
            s.synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(kernel,)) for kernel in shapes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for kernel in shapes:
        assert len(outs[kernel]) == 20
        for data, out in zip(cases[kernel], outs[kernel]):
            check(data, out)


@EACH_KERNEL
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_second_gpu(kernel):
    m, k, l = {"registers": (512, 1024, 2), "split": (512, 2048, 2), "bulk": (2048, 16384, 1)}[kernel]
    takes_kernel(m, k, l, kernel)
    data = tuple(t.to("cuda:1") for t in inputs.random_inputs(m, k, l, seed=41))
    submission.custom_kernel(inputs.random_inputs(m, k, l, seed=40))  # cache entry for cuda:0 first
    assert torch.cuda.current_device() == 0
    out = submission.custom_kernel(inputs.poisoned(data))
    assert out.device == torch.device("cuda:1")
    torch.cuda.synchronize("cuda:1")
    check(data, out)


def _resident_bytes():
    """The process's resident memory now (not the peak, which earlier tests may have set)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_ten_thousand_calls_grow_nothing():
    """What a call could grow: the plan and compile caches, the process's memory (argument storage,
    launch objects), the device's (driver allocations show in mem_get_info)."""
    data = inputs.random_inputs(256, 1024, 2, seed=5)
    for _ in range(100):
        submission.custom_kernel(data)
    torch.cuda.synchronize()
    plans, kernels = len(submission._plans), len(submission._compiled)
    free = torch.cuda.mem_get_info()[0]
    rss = _resident_bytes()
    for _ in range(10_000):
        submission.custom_kernel(data)
    torch.cuda.synchronize()
    assert (len(submission._plans), len(submission._compiled)) == (plans, kernels)
    assert torch.cuda.mem_get_info()[0] >= free - (2 << 20)
    assert _resident_bytes() - rss < 8 << 20  # a leak of ~1 KiB a call shows
    check(data, data[6])
