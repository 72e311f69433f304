"""``services.replay.links.ReroutableReplay``: ``ack`` and ``rejoin`` wait out a replay outage, then give up."""

import pytest
from structlog.testing import capture_logs

from services.replay import links


class _Outage:
    """A replay client whose first ``failures`` calls of ``ack``/``rejoin`` raise ``error``; later ones answer 7."""

    address = "127.0.0.1:1"

    def __init__(self, failures: int, error: type[Exception] = ConnectionError) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def _call(self, *args):
        self.calls += 1
        if self.calls > 1000:
            raise RuntimeError("still retrying after 1000 calls")
        if self.calls <= self.failures:
            raise self.error("scripted")
        return 7

    ack = rejoin = _call


def _replay(client: _Outage, patience_s: float = 300.0) -> links.ReroutableReplay:
    replay = links.ReroutableReplay(client.address, ack_patience_s=patience_s)
    replay.client = client
    return replay


def test_ack_and_rejoin_wait_out_an_outage_polling_and_logging(monkeypatch):
    monkeypatch.setattr(links, "OUTAGE_POLL_S", 0.01)
    client = _Outage(failures=2)
    with capture_logs() as logs:
        assert _replay(client).ack(["lease-1"]) == 7
    assert client.calls == 3 and [e["event"] for e in logs] == ["ack_waiting_for_replay"] * 2
    client = _Outage(failures=1)
    assert _replay(client).rejoin("learner", 3) == 7 and client.calls == 2


def test_ack_raises_the_outage_after_its_patience_and_other_errors_at_once(monkeypatch):
    monkeypatch.setattr(links, "OUTAGE_POLL_S", 0.01)
    client = _Outage(failures=10**9)  # down for good
    with pytest.raises(ConnectionError, match="scripted"):
        _replay(client, patience_s=0.1).ack(["lease-1"])
    assert client.calls >= 2  # it did wait: more than one try
    client = _Outage(failures=10**9, error=ValueError)
    with pytest.raises(ValueError, match="scripted"):
        _replay(client).ack(["lease-1"])
    assert client.calls == 1
