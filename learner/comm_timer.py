"""Per-step time spent in DeepSpeed collectives (the scaling article's "communication time per step")."""

from __future__ import annotations


class CommTimer:
    """Seconds spent in DeepSpeed collectives per step, from ``deepspeed.comm``'s comms logger.

    The logger keeps, per op name, a cumulative timer whose running total it appends after every call
    (milliseconds); the newest total per name minus the one seen at the previous ``lap`` is that op's
    time since. Lists are trimmed to their newest entry so memory stays flat over a long run.
    """

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}
        self.lap()  # the logger is process-wide: start from what earlier engines already logged

    def lap(self) -> float:
        """Collective seconds since the previous ``lap`` (0 when the logger is off)."""
        from deepspeed.comm import comms_logger

        total = 0.0
        for name, sizes in comms_logger.comms_dict.items():
            newest = max((v[1][-1] for v in sizes.values() if v[1]), default=0.0)
            total += max(newest - self._seen.get(name, 0.0), 0.0)
            self._seen[name] = max(newest, self._seen.get(name, 0.0))
            for v in sizes.values():
                for i in (1, 2, 3):
                    del v[i][:-1]
        return total / 1000.0
