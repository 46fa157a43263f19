"""The CPU census of a forward (``sglang_wgkv.testing.op_count``) counts a read to the host as a sync
exactly when what it reads lives on the device when served, and ops on host copies as no launch."""

import numpy as np
import pytest
import torch

from sglang_wgkv.testing.op_count import counting_ops, totals

pytestmark = pytest.mark.core


def census(body, device_tensors=(), host_tensors=()) -> dict:
    with counting_ops(device_tensors, host_tensors) as counts:
        body()
    return totals(counts)


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.tolist(),
        lambda t: t.cpu(),
        lambda t: t.cpu().numpy(),  # one copy to the host, one wait
        lambda t: np.asarray(t),
        lambda t: t[1:].tolist(),  # a view of a device tensor is on the device
        lambda t: int(t[0]),
    ],
)
def test_a_host_read_of_a_device_tensor_is_one_sync(read):
    state = torch.arange(4)
    assert census(lambda: read(state + 1)).get("sync") == 1  # made by an op: on the device
    assert census(lambda: read(state), device_tensors=[state]).get("sync") == 1


def test_host_copies_and_host_arrays_are_read_without_a_sync():
    seq_lens_cpu = torch.tensor([5, 7])
    host_array = torch.from_numpy(np.arange(3))

    def body():
        (seq_lens_cpu - 1).tolist()  # SGLang's host copy: the op and its read stay on the host
        host_array[1:].tolist()

    assert census(body, host_tensors=[seq_lens_cpu]) == {}


def test_an_op_on_a_device_and_a_host_tensor_is_a_launch_on_the_device():
    device, host = torch.arange(3), torch.ones(3, dtype=torch.int64)
    got = census(lambda: (device + host).tolist(), device_tensors=[device], host_tensors=[host])
    assert got == {"torch": 1, "sync": 1}


def test_an_index_by_a_boolean_mask_is_a_sync():
    t = torch.arange(5)

    def body():
        t[t > 2]  # the mask's positions go through the host
        t[torch.tensor([1, 2])]  # positions given: a gather
        u = t.clone()
        u[u > 1] = 0

    got = census(body, device_tensors=[t])
    assert got["sync"] == 2


def test_a_blocking_copy_from_the_host_into_a_device_tensor_counts_as_a_sync():
    """``t[i] = x`` on a 1-D device tensor copies a host scalar into its 0-dim element (a pageable
    copy, then a wait for the stream), and ``t[idx] = x`` moves it to the device first; a fill of a
    narrowed slice, a row of a 2-D tensor (a fill), ``index_fill_`` and a non-blocking copy do not
    wait."""
    from sglang_wgkv.testing.op_count import counting_ops

    flat, table, host = torch.zeros(5), torch.zeros(3, 4), torch.ones(3)
    with counting_ops([flat, table], [host]) as counts:
        flat[1] = 2.0
        flat[:3].copy_(host)
        flat[torch.tensor([0, 2])] = 5.0  # index_put_ moves the host scalar to the device first
    assert counts[("sync", "copy_")] == 2 and counts[("sync", "index_put_")] == 1
    with counting_ops([flat, table], [host]) as counts:
        flat.narrow(0, 2, 1).fill_(3.0)
        table[1] = 1.0
        flat[:3].copy_(host, non_blocking=True)
        flat.index_fill_(0, torch.tensor([0, 2]), 5.0)
    assert not [k for k in counts if k[0] == "sync"] and counts[("torch", "fill_")] == 2
