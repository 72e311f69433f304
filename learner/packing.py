"""Packed micro-batches: a micro-batch's rows concatenated into one sequence, no padding.

The learner's forwards never pad. The rows of a micro-batch (each its real ``prompt + response`` tokens) are laid
end to end in one ``[1, N]`` sequence, ``position_ids`` restart at 0 at every row, and attention never crosses a
row boundary (``cu_seqlens``, the FlashAttention varlen convention; TRL's ``padding_free``, verl's
``use_remove_padding``). Two attention kernels do that, registered with transformers' ``AttentionInterface``
under ``PACKED_ATTENTION`` names and picked by ``LearnerConfig.attn_kernel``:

- ``varlen``: ``torch.nn.attention.varlen.varlen_attn``, PyTorch's own variable-length FlashAttention (CUDA,
  bf16/fp16, compute capability >= 8.0). It ships in the torch wheel, so nothing is compiled from source;
  ``flash-attn`` would be (no wheel on PyPI for the lock's torch).
- ``per_row``: ``scaled_dot_product_attention`` causal over each row's span in turn (on a CPU its math kernel).
  Runs on any device and dtype (the CPU path and the tests'); its cost is ``sum_i l_i^2`` like varlen's, not
  ``N^2``.

The model's attention mask is not used (``attention_mask`` stays ``None``): a packed model given padded input
(an attention mask) raises rather than attending to padding; unpacked rows without a mask are each one
sequence.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

PACKED_ATTENTION = {"varlen": "gyre_packed_varlen", "per_row": "gyre_packed_per_row"}
"""``LearnerConfig.attn_kernel`` -> the ``attn_implementation`` name a learner model is loaded with."""


class PackedKernelError(ValueError):
    """The packed attention kernel asked for cannot run here (device, dtype or torch build)."""


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch's rows packed into one sequence.

    ``b`` rows of real lengths ``l_i`` (``N = sum_i l_i`` tokens, ``W = max_i l_i``). Row ``i`` occupies packed
    positions ``[cu_seqlens[i], cu_seqlens[i + 1])``.
    """

    rows: torch.Tensor
    """``[b]`` int64: the batch rows, in packing order."""

    input_ids: torch.Tensor
    """``[1, N]`` int64: the rows' real tokens, end to end."""

    position_ids: torch.Tensor
    """``[1, N]`` int64: ``0 .. l_i - 1`` within each row."""

    cu_seqlens: torch.Tensor
    """``[b + 1]`` int32: cumulative row lengths, starting at 0."""

    max_len: int
    """``W``: the longest row (tokens)."""

    scored: torch.Tensor
    """``[b, W - 1]`` int64: packed position of the token that scores ``(row, j)``, i.e. ``cu_seqlens[i] + j``
    (clamped into the row past its end, where ``valid`` is False)."""

    valid: torch.Tensor
    """``[b, W - 1]`` bool: ``j < l_i - 1`` (a real next token exists)."""

    @classmethod
    def build(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor,
              device: torch.device | str) -> "PackedRows":
        """Pack ``rows`` of a right-padded batch.

        Args:
            input_ids: ``[B, L]`` int64, right-padded (``TrainBatch.input_ids``).
            attention_mask: ``[B, L]`` 0/1, a prefix of ones per row.
            rows: ``[b]`` int64 row indices (any order, no repeats needed).
            device: where the packed tensors go.

        Raises:
            ValueError: no rows, or a row with fewer than 2 real tokens (nothing to score).
        """
        if rows.numel() == 0:
            raise ValueError("cannot pack an empty micro-batch")
        lengths = attention_mask[rows].sum(dim=1).to(torch.int64)  # [b]
        if int(lengths.min()) < 2:
            bad = int(rows[int(lengths.argmin())])
            raise ValueError(f"row {bad} has {int(lengths.min())} real tokens; a trained row needs >= 2")
        width = int(lengths.max())
        ar = torch.arange(width)
        real = ar.unsqueeze(0) < lengths.unsqueeze(1)  # [b, W]
        ids = input_ids[rows, :width][real]  # row-major: rows end to end
        positions = ar.unsqueeze(0).expand(len(rows), width)[real]
        cu = torch.zeros(len(rows) + 1, dtype=torch.int64)
        cu[1:] = lengths.cumsum(0)
        j = ar[: width - 1].unsqueeze(0)
        valid = j < (lengths - 1).unsqueeze(1)
        scored = cu[:-1].unsqueeze(1) + torch.minimum(j, (lengths - 1).unsqueeze(1))
        return cls(rows=rows, input_ids=ids.unsqueeze(0).to(device), position_ids=positions.unsqueeze(0).to(device),
                   cu_seqlens=cu.to(device=device, dtype=torch.int32), max_len=width, scored=scored.to(device),
                   valid=valid.to(device))

    @property
    def tokens(self) -> int:
        """``N``: real tokens packed."""
        return int(self.input_ids.shape[1])

    def model_kwargs(self) -> dict:
        """What the HF model's forward takes for this packing: ``input_ids``, ``position_ids`` and the
        FlashAttention-style ``cu_seq_lens_q/k``, ``max_length_q/k`` the packed kernels read."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "cu_seq_lens_q": self.cu_seqlens,
                "cu_seq_lens_k": self.cu_seqlens, "max_length_q": self.max_len, "max_length_k": self.max_len}

    def targets(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions [n], next tokens [n])`` of the ``n`` scored places ``mask`` ``[b, W - 1]`` selects:
        packed positions whose hidden state scores the token after it, and that token's id."""
        pos = self.scored[mask & self.valid]
        return pos, self.input_ids[0, pos + 1]

    def unpack(self, flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[b, W - 1]`` float32 holding ``flat`` ``[n]`` (computed at ``targets(mask)``) at ``mask``, 0 elsewhere;
        differentiable."""
        out = torch.zeros(self.valid.shape, dtype=torch.float32, device=flat.device)
        return out.masked_scatter(mask & self.valid, flat.float())

    def gather(self, per_token: torch.Tensor) -> torch.Tensor:
        """``[b, W - 1]`` of a packed per-position tensor ``[N]`` at each scored place (0 where not ``valid``)."""
        return torch.where(self.valid, per_token[self.scored], torch.zeros((), dtype=per_token.dtype,
                                                                              device=per_token.device))


def _segments(cu: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _per_row_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Causal SDPA over each row's span of the packed ``[1, H, N, D]`` query/key/value in turn (on a CPU with
    SDPA's math kernel, ``_cpu_math``); returns ``([1, N, H, D], None)`` as transformers' attention functions do.
    Unpacked input without a mask: every batch row is one whole sequence."""
    cu = _require_cu(kwargs, attention_mask)
    if cu is None:
        return _whole_rows(query, key, value, dropout, scaling)
    gqa = query.shape[1] != key.shape[1]
    with _cpu_math(query.device):
        parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout,
                                                is_causal=True, scale=scaling, enable_gqa=gqa)
                 for a, b in _segments(cu)]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def _cpu_math(device: torch.device):
    """SDPA's math kernel on a CPU: on short rows its backward runs faster there than the CPU flash kernel's (the
    default recipe's learner step: 4.9-5.1 -> 4.2 s, bf16, rows of ~60 tokens, 2 cores; measured); other devices keep SDPA's
    own choice."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)


def _varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """``varlen_attn`` (FlashAttention, causal) over the packed rows; ``([1, N, H, D], None)``."""
    from torch.nn.attention.varlen import varlen_attn

    cu = _require_cu(kwargs, attention_mask)
    if cu is None:
        return _whole_rows(query, key, value, dropout, scaling)
    if dropout:
        raise PackedKernelError(f"attn_kernel 'varlen' has no attention dropout (the model asks {dropout}); "
                                "use attn_kernel 'per_row'")
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [N, H, D]
    width = int(kwargs["max_length_q"])
    params = _parameters(varlen_attn)
    extra = {"scale": scaling} if "scale" in params else {}
    if q.shape[1] != k.shape[1]:  # grouped-query attention
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:  # an older varlen_attn: one key/value head per query head
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if "window_size" in params:  # torch >= 2.11: (-1, 0) is causal
        extra["window_size"] = (-1, 0)
    else:  # torch 2.10
        extra["is_causal"] = True
    out = varlen_attn(q, k, v, cu, cu, width, width, **extra)
    return out.unsqueeze(0), None


@functools.lru_cache(maxsize=4)
def _parameters(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _whole_rows(query, key, value, dropout: float, scaling):
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _require_cu(kwargs: dict, attention_mask) -> torch.Tensor | None:
    """The packing's ``cu_seqlens`` (None: unpacked rows, each one whole sequence). Raises ``ValueError`` for
    padded input (an attention mask): these kernels never read one."""
    if attention_mask is not None:
        raise ValueError("a learner model (packed attention) was given an attention mask: pass "
                         "learner.packing.PackedRows.model_kwargs() (rows packed, no padding)")
    return kwargs.get("cu_seq_lens_q")


def varlen_available(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """None when ``varlen_attn`` runs on ``device`` in ``dtype``, else why not (one clause)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"it needs a CUDA device (this learner runs on {device.type})"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"it needs bf16 or fp16 (this learner trains in {dtype})"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401 (only whether it exists)
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10 does)"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return f"it needs compute capability >= 8.0 (this GPU has {torch.cuda.get_device_capability(device)})"
    return None


def packed_attn_implementation(kernel: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """The ``attn_implementation`` to load a learner model with, for ``LearnerConfig.attn_kernel``.

    ``auto`` takes ``varlen`` where ``varlen_available`` says it runs, else ``per_row``.

    Raises:
        PackedKernelError: ``varlen`` asked for where it cannot run (the message names why and the fallback).
    """
    if kernel not in ("auto", "varlen", "per_row"):
        raise PackedKernelError(f"attn_kernel {kernel!r}; expected 'auto', 'varlen' or 'per_row'")
    why = varlen_available(device, dtype) if kernel != "per_row" else "not asked for"
    if kernel == "varlen" and why:
        raise PackedKernelError(f"attn_kernel 'varlen' cannot run: {why}; set learner.engine.attn_kernel to 'auto' "
                                "(falls back to 'per_row' SDPA, exact, slower on GPUs) or 'per_row'")
    return PACKED_ATTENTION["varlen" if kernel != "per_row" and not why else "per_row"]


def _no_padding_mask(batch_size, cache_position=None, kv_length=None, kv_offset=0, mask_function=None,
                     attention_mask=None, **kwargs):
    """transformers' mask hook for the packed kernels: they take no mask, so padding is refused here (one clear
    error instead of a silently wrong attention over left padding)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("a learner model (packed attention) was given padded rows (an attention_mask with zeros): "
                         "pass learner.packing.PackedRows.model_kwargs() (rows packed, no padding)")
    return None


for _name in PACKED_ATTENTION.values():
    AttentionMaskInterface.register(_name, _no_padding_mask)
AttentionInterface.register(PACKED_ATTENTION["per_row"], _per_row_attention)
AttentionInterface.register(PACKED_ATTENTION["varlen"], _varlen_attention)
