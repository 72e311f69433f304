"""The learner's end of the NCCL weight transport: announce each version's manifest on the publisher (served by
``WeightService.Announce``), then broadcast its tensors from rank 0 (``proto.broadcast``). The rollout's end is
``services.rollout.transport.nccl``; the gRPC transport's learner end is ``services.learner.weight_server``.
"""

from __future__ import annotations

import torch

from gyre.learner.publisher import WeightPublisher
from gyre.proto.broadcast import Broadcast, require_cuda
from gyre.proto.manifest import TensorMeta, tensor_metas
from gyre.proto.timeline import SHARED
from gyre.proto.weight_transport import NcclTransportConfig

__all__ = ["NcclWeightSender", "open_trainer_broadcast"]


class NcclWeightSender:
    """Learner side: announce a version on ``publisher`` (served by ``WeightService.Announce``), then
    broadcast its tensors from rank ``src`` in manifest order.

    Args:
        publisher: the learner's ``WeightPublisher`` (its server carries the control channel).
        broadcast: the data path (``open_trainer_broadcast`` in production).
    """

    def __init__(self, publisher: WeightPublisher, broadcast: Broadcast, src: int = 0) -> None:
        self.publisher, self.broadcast, self.src = publisher, broadcast, src

    def send(self, version: int, named: list[tuple[str, torch.Tensor]], timeline: int = SHARED) -> list[TensorMeta]:
        """Publish ``version`` of ``timeline``: checksums on the tensors' device, manifest, then the broadcast.

        Blocks until every rank received every tensor. Raises ``ValueError`` for a version that is not
        newer than the published one (nothing is sent) and ``ChunkError`` for an unsupported dtype.
        """
        contiguous = [(n, t.detach().contiguous()) for n, t in named]
        metas = tensor_metas(contiguous)
        self.publisher.announce(version, metas, timeline)
        for _, t in contiguous:
            self.broadcast(t, self.src)
        return metas


def open_trainer_broadcast(config: NcclTransportConfig) -> Broadcast:
    """Learner side of vLLM's NCCL weight-transfer group (rank 0, TCPStore rendezvous at
    ``master_address:master_port``); blocks until all ``world_size`` ranks joined.

    Raises:
        TransportUnavailableError: no CUDA device here.
    """
    require_cuda("open_trainer_broadcast")
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    comm = trainer_init({"master_address": config.master_address, "master_port": config.master_port,
                         "world_size": config.world_size})

    def broadcast(tensor: torch.Tensor, src: int) -> None:
        comm.broadcast(tensor, src=src, stream=torch.cuda.current_stream())
    return broadcast
