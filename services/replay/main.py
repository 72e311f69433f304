"""Replay service without Ray: ``python -m gyre.services.replay.main --config FILE.yaml --dir DIR --port N``.

``--config`` is a YAML mapping of ``ReplayConfig`` fields (the ``replay:`` section of a recipe);
``--dir`` overrides its ``dir``. ``--port 0`` (the default) binds a port the OS picks; ``--port-file PATH``
then tells a starting process which (``services.common.port_file``). Restores from the directory, serves
until SIGTERM/SIGINT, then stops the server and closes the WAL.
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

import yaml

from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.services.common import port_file
from gyre.services.replay import server as replay_server
from gyre.services.replay.metrics import serve_metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gyre.services.replay.main", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML file of ReplayConfig fields")
    parser.add_argument("--dir", help="WAL and snapshot directory (overrides the config's dir)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="gRPC port; 0 (default): one the OS picks")
    parser.add_argument("--port-file", help="once serving, write the bound gRPC port to this file")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    args = parser.parse_args(argv)
    fields = (yaml.safe_load(Path(args.config).read_text()) or {}) if args.config else {}
    config = ReplayConfig(**{**fields, **({"dir": args.dir} if args.dir else {})})
    buffer = TrajectoryBuffer(config)
    server, port = replay_server.serve(buffer, host=args.host, port=args.port)
    if args.port_file:
        port_file.write(args.port_file, port)
    if args.metrics_port is not None:
        serve_metrics(buffer, args.metrics_port, args.host)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()
    buffer.close()


if __name__ == "__main__":
    main()
