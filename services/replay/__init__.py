"""The replay service: gRPC server and its ingest stage, client, reroutable links, metrics, Ray actor, and the
standalone process (``python -m gyre.services.replay.main``)."""
