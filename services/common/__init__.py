"""Shared by every service: gRPC plumbing, TLS and token auth, structured logs, Prometheus metrics, actor helpers."""
