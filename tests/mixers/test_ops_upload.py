"""``specla.ops.upload_ints``: host ints on the device without a stream synchronisation (pinned
and queued on CUDA), the values exact, each upload its own even when the pinned blocks are
reused while earlier copies may still be queued."""

import pytest
import torch

from specla.ops import upload_ints
from trees import DEV


def test_upload_ints_values_dtype_and_device():
    vals = [0, -1, 2**62, -(2**63), 31999, 7]
    t = upload_ints(vals, DEV)
    assert t.dtype == torch.int64 and t.device.type == torch.device(DEV).type and t.shape == (6,)
    assert t.tolist() == vals
    assert upload_ints([], DEV).shape == (0,)
    with pytest.raises(ValueError, match="Overflow"):
        upload_ints([2**63], DEV)
    for bad in ([1.5], [2, 0.5], [True, False], [1j]):
        with pytest.raises(TypeError, match="upload_ints takes integers, got values of torch"):
            upload_ints(bad, DEV)
    import numpy

    assert upload_ints([numpy.int32(5), numpy.int64(-2)], DEV).tolist() == [5, -2]


def test_uploads_behind_queued_work_each_keep_their_values():
    """Many uploads queued behind device work (on a GPU a large matmul, so the copies run long
    after the host moved on and freed the pinned sources): every tensor holds its own values."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2048 if DEV == "cuda" else 64, 2048 if DEV == "cuda" else 64, device=DEV)
    want, got = [], []
    for i in range(50):
        x = x @ x * 1e-3  # device work the copies queue behind
        vals = torch.randint(-(2**40), 2**40, (int(torch.randint(1, 300, (1,), generator=g)),), generator=g).tolist()
        want.append(vals)
        got.append(upload_ints(vals, DEV))
    assert [t.tolist() for t in got] == want
