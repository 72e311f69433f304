"""Capturing a policy version where the weights live: the only part of publishing that blocks a learner step.

``capture_weights`` copies every published parameter into a private tensor on its own device (a bf16 cast-copy
on the GPU runs at memory bandwidth: ~3 GB in milliseconds for a 1.5B model), so the optimizer may step right
after; ``learner.background_publish.BackgroundPublisher`` moves the copy to host memory, checksums it and hands it
to the weight server behind the next steps. Under ZeRO-3 the parameters are gathered a bucket at a time
(``bucket_bytes`` of full parameters at once, every rank taking part) and only rank 0 keeps its copy: no rank
holds a host copy it throws away.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

VALUE_HEAD = "value_head"
"""Module name of the critic's value head on a policy model (``learner.engine``); never published."""
BUCKET_BYTES = 256 << 20
"""Full-parameter bytes (in the published dtype) gathered at once under ZeRO-3."""


def published_parameters(engine) -> list[tuple[str, torch.nn.Parameter]]:
    """``(HF name, parameter)`` of what a version carries: every parameter but a tied ``lm_head.weight``
    (vLLM ties it) and the critic's value head (not part of the policy)."""
    return [(name, p) for name, p in engine.module.named_parameters()
            if not ((engine.tied_lm_head and name == "lm_head.weight") or name.startswith(VALUE_HEAD + "."))]


def buckets(params: list[tuple[str, torch.nn.Parameter]], bucket_bytes: int,
            itemsize: int) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive parameters grouped so that each group's full size (``ds_numel`` under ZeRO-3, else ``numel``,
    times ``itemsize`` bytes) stays within ``bucket_bytes``; a parameter larger than that is a bucket alone.

    Raises:
        ValueError: ``bucket_bytes`` < 1.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes ({bucket_bytes}) must be >= 1")
    out: list[list] = []
    size = bucket_bytes  # start a new bucket with the first parameter
    for name, p in params:
        nbytes = getattr(p, "ds_numel", p.numel()) * itemsize
        if size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, p))
        size += nbytes
    return out


def host_weights(engine, dtype: torch.dtype | None = torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
    """The published parameters as CPU contiguous copies in ``dtype`` (``None``: the training dtype), gathered one
    parameter at a time under ZeRO-3 (every rank must call it): ``LearnerEngine.named_weights``."""
    out = []
    for name, param in published_parameters(engine):
        with engine._gathered([param]):
            out.append((name, param.detach().to("cpu", dtype=dtype or param.dtype, copy=True).contiguous()))
    return out


def capture_weights(engine, dtype: torch.dtype | None = torch.bfloat16,
                    bucket_bytes: int = BUCKET_BYTES) -> list[tuple[str, torch.Tensor]]:
    """Private copies of the published parameters, on the parameters' device, in ``dtype`` (``None``: the
    training dtype). Returns ``[(HF name, tensor)]`` (full shapes, contiguous) on rank 0 and ``[]`` on other ranks
    under ZeRO-3 (which must all call this: the gathers are collectives). Work is queued on the current CUDA
    stream, not waited for: a consumer on another stream waits for an event recorded after this returns.
    """
    params = published_parameters(engine)
    if engine.config.zero_stage != 3:
        return [(n, p.detach().to(dtype=dtype or p.dtype, copy=True).contiguous()) for n, p in params]
    import deepspeed

    keep = not dist.is_initialized() or dist.get_rank() == 0
    itemsize = torch.empty((), dtype=dtype).element_size() if dtype is not None else 4
    out = []
    for bucket in buckets(params, bucket_bytes, itemsize):
        with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
            if keep:
                out.extend((n, p.detach().to(dtype=dtype or p.dtype, copy=True).contiguous()) for n, p in bucket)
    return out
