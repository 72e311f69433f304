"""Hand-written test doubles and builders, in one module (house style §8)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

from gyre.rollout.types import Sample
from gyre.proto.trajectory import Trajectory, make_ids, to_table


def make_group(prompt_index: int, n: int = 4, attempt: int = 0, version: int = 0, rewards=None,
               response_len: int = 3, spans: tuple[list[int], list[int]] | None = None,
               timeline: int = 0) -> list[Trajectory]:
    """``n`` trajectories of one prompt (a GRPO group) with simple deterministic contents; ``timeline``:
    their ``policy_timeline``."""
    rewards = rewards if rewards is not None else [float(i % 2) for i in range(n)]
    out = []
    for s in range(n):
        tid, gid = make_ids(prompt_index, s, attempt)
        starts, versions = spans if spans else ([0], [version])
        out.append(Trajectory(
            trajectory_id=tid, group_id=gid, prompt_index=prompt_index, sample_index=s, attempt=attempt,
            task="basic_arithmetic", prompt_token_ids=[1, 2, 3], response_token_ids=list(range(10, 10 + response_len)),
            behaviour_logprobs=[-0.5] * response_len, reward=rewards[s], finish_reason="stop",
            version_span_starts=list(starts), version_span_versions=list(versions),
            reward_fn_version="test", rollout_id="r0", created_at=0.0, policy_timeline=timeline))
    return out


def group_table(prompt_index: int, **kw):
    return to_table(make_group(prompt_index, **kw))


async def until(cond, what: str, timeout_s: float = 30.0) -> None:
    """Poll ``cond()`` every 10 ms on the running event loop until it holds; after ``timeout_s`` seconds raise
    ``AssertionError`` naming ``what`` (a generous deadline: a loaded machine only makes it take longer)."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.01)


class FakeClock:
    """Monotonic clock under the test's control (seconds)."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class FakeEngine:
    """Stands in for ``rollout.engine.RolloutEngine``: answers ``"{a+b}"``-style text from a script."""

    def __init__(self, texts: list[str], version: int = 0) -> None:
        self.texts, self.version, self.updates = texts, version, []

    async def generate(self, prompt_token_ids, n, sampling, request_id, seed=None):
        return [Sample(token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="stop",
                       version_span_starts=[0, 1], version_span_versions=[self.version, self.version + 1],
                       text=self.texts[i % len(self.texts)]) for i in range(n)]

    async def generate_greedy(self, prompts, max_new_tokens):
        return [(await self.generate(p, 1, None, "eval"))[0] for p in prompts]

    async def update_weights(self, version, named_tensors, rewind=False):
        if version <= self.version and not rewind:  # as RolloutEngine: StaleVersionError
            raise ValueError(f"weight version ({version}) must be newer than the current one ({self.version})")
        self.version = version
        self.updates.append(version)
        return 0.01


class FakeReplay:
    """In-process ``TrajectoryBuffer`` behind the client methods, with scriptable outages."""

    def __init__(self, buffer, fail_inserts: int = 0) -> None:
        self.buffer, self.fail_inserts, self.insert_calls = buffer, fail_inserts, 0

    def lease_prompts(self, consumer, count, ttl_s=0.0, below=0, max_ready=0, policy_version=None):
        return self.buffer.lease_prompts(consumer, count, ttl_s or None, below or None, max_ready or None,
                                         policy_version)

    def insert(self, table):
        self.insert_calls += 1
        if self.fail_inserts > 0:
            self.fail_inserts -= 1
            raise ConnectionError("replay down (scripted)")
        return self.buffer.insert(table)

    def info(self):
        from types import SimpleNamespace

        return SimpleNamespace(**self.buffer.info())

    def sample(self, num_groups, learner_version, timeout_s, consumer="", prompt_indices=None, request_id=""):
        return self.buffer.sample(num_groups, learner_version, timeout_s, consumer, prompt_indices, request_id)

    def ack(self, lease_ids):
        return self.buffer.ack(lease_ids)

    def rejoin(self, consumer, learner_version, timeline=0):
        return self.buffer.rejoin(consumer, learner_version, timeline)


class FakeTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [len(m["content"]) for m in messages]


class SlowEngine(FakeEngine):
    """``FakeEngine`` whose ``generate`` takes ``delay_s`` seconds and records each finished group's
    request id (``"{group_id}@{rollout_id}"``) in ``generated``."""

    def __init__(self, texts: list[str], delay_s: float, version: int = 0) -> None:
        super().__init__(texts, version)
        self.delay_s, self.generated = delay_s, []

    async def generate(self, prompt_token_ids, n, sampling, request_id, seed=None):
        import asyncio

        await asyncio.sleep(self.delay_s)
        out = await super().generate(prompt_token_ids, n, sampling, request_id, seed)
        self.generated.append(request_id)
        return out


class OutageReplay(FakeReplay):
    """``FakeReplay`` that can be switched off: while ``down`` every call raises ``ConnectionError``;
    inserts of a prompt index in ``refuse`` raise ``refuse[index]`` (a permanent refusal)."""

    def __init__(self, buffer, refuse: dict | None = None) -> None:
        super().__init__(buffer)
        self.down, self.refuse = False, refuse or {}

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("replay down (scripted outage)")

    def lease_prompts(self, consumer, count, ttl_s=0.0, below=0, max_ready=0, policy_version=None):
        self._check()
        return super().lease_prompts(consumer, count, ttl_s, below, max_ready, policy_version)

    def insert(self, table):
        self.insert_calls += 1
        self._check()
        for index in set(table.column("prompt_index").to_pylist()) & self.refuse.keys():
            raise self.refuse[index]
        return self.buffer.insert(table)

    def info(self):
        self._check()
        return super().info()


class FakeRpcError(Exception):
    """Stands in for ``grpc.RpcError``: ``code().name`` is the status name, e.g. ``"INVALID_ARGUMENT"``."""

    def __init__(self, code_name: str, details: str = "") -> None:
        super().__init__(f"{code_name}: {details}")
        self._code_name = code_name

    def code(self):
        from types import SimpleNamespace

        return SimpleNamespace(name=self._code_name)


class _Remote:
    """``handle.method.remote(...)`` calling ``fn`` at once (with ``ray.get`` patched to return its argument)."""

    def __init__(self, fn) -> None:
        self.remote = fn


class FakeLearnerHandle:
    """A ``LearnerActor`` handle as ``services.control.orchestration.controller`` polls it: ``describe``, ``progress``,
    ``version``, ``run`` (each ``.remote``). It holds the metrics rows of the steps it trained so far (the
    actor keeps them all, driver or not); ``run(n)`` is recorded in ``runs``, ``finish(step)`` trains one step."""

    def __init__(self, steps: list[int], running: bool = False) -> None:
        self.rows = [{"step": s, "loss": 0.1 * s} for s in steps]
        self.running, self.runs = running, []
        self.describe = _Remote(lambda: SimpleNamespace(version=self._version(), running=self.running))
        self.progress = _Remote(lambda cursor: ([dict(r) for r in self.rows[cursor:]], not self.running, None))
        self.version = _Remote(self._version)
        self.run = _Remote(self.runs.append)

    def _version(self) -> int:
        return max((r["step"] for r in self.rows), default=0)

    def finish(self, step: int, last: bool = False) -> None:
        self.rows.append({"step": step, "loss": 0.1 * step})
        self.running = not last


class PortThief:
    """Plays another process that takes a port the moment its finder lets it go: once ``install``ed, every TCP
    socket of this process that was bound to port 0 has, when closed, its port bound and listened on at once by
    a socket the thief holds (``taken`` lists those ports; ``release`` closes them). Code that picks a "free"
    port that way and binds it later fails with EADDRINUSE; code that binds port 0 and keeps the socket, or
    binds outside Python's ``socket`` module (gRPC, torch's TCPStore), never meets the thief."""

    def __init__(self) -> None:
        self.taken: list[int] = []
        self._held: list[socket.socket] = []
        self._real = socket.socket

    def install(self, monkeypatch=None) -> "PortThief":
        """Replace ``socket.socket`` (through ``monkeypatch`` if given, else for the rest of the process)."""
        thief, real = self, self._real

        class Socket(real):
            def bind(self, address):
                super().bind(address)
                self._port0 = (self.family in (socket.AF_INET, socket.AF_INET6) and self.type == socket.SOCK_STREAM
                               and address[1] == 0)

            def close(self):
                port = self.getsockname()[1] if getattr(self, "_port0", False) and self.fileno() != -1 else None
                super().close()
                if port:
                    thief.take(port)

        if monkeypatch is not None:
            monkeypatch.setattr(socket, "socket", Socket)
        else:
            socket.socket = Socket
        return self

    def take(self, port: int) -> None:
        """Bind and listen on ``port`` (all interfaces) and hold it."""
        sock = self._real()
        sock.bind(("", port))
        sock.listen()
        self._held.append(sock)
        self.taken.append(port)

    def release(self) -> None:
        for sock in self._held:
            sock.close()
        self._held.clear()
