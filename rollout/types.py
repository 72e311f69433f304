"""Nouns of the rollout service, free of vLLM so tests and other services can use them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One sampled response to one prompt."""

    token_ids: list[int]
    """[T] response token ids (prompt excluded)."""
    logprobs: list[float]
    """[T] behaviour logprob of each response token: natural log, after temperature/top-p."""
    finish_reason: str
    """``"stop"`` (EOS or a stop token) or ``"length"`` (reached ``max_new_tokens``)."""
    version_span_starts: list[int]
    """[S] token offset where each version span starts: first is 0, strictly increasing."""
    version_span_versions: list[int]
    """[S] policy version that sampled each span's tokens; non-decreasing."""
    text: str
    """Detokenized response (special tokens skipped)."""
