"""``device_checksum`` (the NCCL manifests' ``wsum64-v1``) against a plain numpy reference: the batched,
cached-weight implementation must keep the wire value of the algorithm named in every manifest."""

import numpy as np
import pytest
import torch

from gyre.proto.manifest import _STEP_WORDS, device_checksum, device_checksums


def reference(t: torch.Tensor) -> int:
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    words = raw.view(np.int32) if raw.size % 4 == 0 else raw
    weights = np.arange(words.size, dtype=np.int64) % 65521 + 1
    with np.errstate(over="ignore"):
        return int((words.astype(np.int64) * weights).sum(dtype=np.int64)) & 0xFFFF_FFFF_FFFF_FFFF


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (_STEP_WORDS * 2 + 13,)), (torch.bfloat16, (4097, 33)),
                                         (torch.float16, (3,)), (torch.float32, (0,))])
def test_checksum_matches_the_reference_across_steps(dtype, shape):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype) * 1e4
    assert device_checksum(t) == reference(t)


def test_known_value_pins_the_wire_format():
    # wsum64-v1 of float32 [0, 1, ..., 9]: changing it breaks every learner/rollout pair of mixed builds
    assert device_checksum(torch.arange(10, dtype=torch.float32)) == reference(torch.arange(10, dtype=torch.float32))
    assert device_checksum(torch.arange(10, dtype=torch.float32)) == 0xda6200000


def test_batched_checksums_equal_one_by_one():
    ts = [torch.randn(n) for n in (1, 5, 1000)] + [torch.ones(3, dtype=torch.float16)]
    assert device_checksums(ts) == [device_checksum(t) for t in ts] == [reference(t) for t in ts]
    assert device_checksums([]) == []
