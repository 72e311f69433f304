"""``NcclTransport``: manifests over gRPC ``WeightService.Announce``, bytes over an NCCL broadcast.

Learner side (``services.learner.weight_broadcast.NcclWeightSender``): for each version, compute every tensor's checksum on the GPU
(``proto.tensor_chunks.device_checksum``), announce ``(version, manifest)`` on the publisher, then
broadcast the tensors in manifest order from rank 0. Rollout side (``NcclTransport``): follow the
``Announce`` stream and hand each newer ``VersionManifest`` to ``on_version``; the rollout engine then
joins the broadcast through vLLM's weight-transfer API (``RolloutEngine.update_weights``), its workers
receive every tensor into fresh buffers, verify them all (``receive_verified``) and only then load
them, so a corrupt transfer never reaches the model. Same version semantics as gRPC: versions only
increase and the engine keeps serving the old one when it refuses a version. Unlike gRPC, a refused NCCL
version is *not* retried: its bytes went by in the one broadcast this rank took part in, so the transport
moves its announce cursor past it and waits for the next version (re-asking would block this rank in a
broadcast the learner never repeats, then pair the next version's bytes with the old manifest).

Both sides are written against ``proto.broadcast.Broadcast`` (``broadcast(tensor, src)`` in place on receivers):
``torch.distributed`` (NCCL in production, gloo in the CPU tests) or vLLM's ``PyNcclCommunicator``.
The group has a fixed size; a rank that dies stalls the others until the group's own timeout.
"""

from __future__ import annotations

import grpc
import structlog

from gyre.proto import weights_pb2, weights_pb2_grpc
from gyre.proto.broadcast import require_cuda
from gyre.utils.retry import reconnect_forever
from gyre.proto.tensor_chunks import ChunkError
from gyre.proto.manifest import CHECKSUM_KIND, TensorMeta, VersionManifest
from gyre.proto.timeline import SHARED, is_new
from gyre.proto.weight_transport import NcclTransportConfig
from gyre.services.common import grpc_common
from gyre.services.common.security import SecurityConfig
from gyre.services.rollout.transport.base import OnVersion, WeightTransport
from gyre.services.rollout.transport.subscriber import StreamThread, latest_version

log = structlog.get_logger("weights")
__all__ = ["NcclTransport", "to_manifest"]
MAX_BACKOFF_S = 10.0
"""Longest wait (seconds) before re-following a broken ``Announce`` stream (the first is ``backoff_s``)."""


class NcclTransport(StreamThread, WeightTransport):
    """Rollout side: follows ``WeightService.Announce`` and hands each newer ``VersionManifest`` to
    ``on_version`` (which must join the broadcast: ``RolloutEngine.update_weights`` does).

    Raises:
        TransportUnavailableError: constructed on a machine without CUDA (unless ``require_gpu=False``,
            for tests whose data path is a CPU stand-in).
    """

    def __init__(self, config: NcclTransportConfig, address: str, on_version: OnVersion, have_version: int = -1,
                 name: str = "", security: SecurityConfig | None = None, require_gpu: bool = True,
                 have_timeline: int = SHARED) -> None:
        if require_gpu:
            require_cuda(f"rollout {name!r}")
        self.address, self.security, self.name = address, security, name
        self.on_version = on_version
        self.have_version, self.have_timeline = have_version, have_timeline
        self._cursor = (have_version, have_timeline)
        """Newest announced ``(version, timeline)`` whose broadcast this rank took part in (applied or refused)."""
        self.backoff_s = config.backoff_s
        self._errors = 0
        self._init_stream_thread(f"weights-nccl-{name}")

    def latest_version(self, timeout_s: float = 2.0) -> int | None:
        return latest_version(self.address, timeout_s, self.security)

    @property
    def delivered_version(self) -> int:
        return self.have_version

    @property
    def errors(self) -> int:
        return self._errors

    def _run(self) -> None:
        reconnect_forever(self._follow, self._stop, (grpc.RpcError, ChunkError), self.backoff_s, MAX_BACKOFF_S,
                          self._broken)

    def _broken(self, exc: BaseException, retry_in_s: float) -> None:
        self._errors += 1
        log.warning("weight_announce_broken", subscriber=self.name, error=str(exc)[:300], kind=type(exc).__name__,
                    retry_in_s=retry_in_s)

    def _follow(self) -> None:
        with grpc_common.channel(self.address, self.security) as ch:
            stub = weights_pb2_grpc.WeightServiceStub(ch)
            self._opened(stub.Announce(weights_pb2.SubscribeRequest(
                have_version=self._cursor[0], have_timeline=self._cursor[1], subscriber=self.name)))
            for msg in self._call:
                manifest = to_manifest(msg)
                if not is_new(manifest.version, manifest.timeline, *self._cursor):
                    continue
                self._deliver(manifest)

    def _deliver(self, manifest: VersionManifest) -> None:
        """Hand one announced version to ``on_version`` (which joins its broadcast); a refusal is counted and
        logged, and the cursor moves past the version either way (its bytes cannot be asked for again)."""
        try:
            self.on_version(manifest.version, manifest, manifest.timeline)
        except Exception as exc:
            self._errors += 1
            log.warning("weight_version_refused", subscriber=self.name, version=manifest.version,
                        kept_version=self.have_version, error=repr(exc)[:300])
        else:
            self.have_version, self.have_timeline = manifest.version, manifest.timeline
        finally:
            self._cursor = (manifest.version, manifest.timeline)


def to_manifest(msg: weights_pb2.VersionManifest) -> VersionManifest:
    """Proto → ``VersionManifest``. Raises ``ChunkError`` for a checksum algorithm this build lacks."""
    if msg.checksum_kind != CHECKSUM_KIND:
        raise ChunkError(f"version {msg.version}: checksum kind {msg.checksum_kind!r}, expected {CHECKSUM_KIND!r}")
    return VersionManifest(msg.version, tuple(
        TensorMeta(t.name, t.dtype, tuple(t.shape), t.nbytes, t.checksum) for t in msg.tensors), msg.checksum_kind,
        msg.timeline)
