"""vLLM's token-in/token-out ``/inference/v1/generate`` route, served from a rollout's own ``RolloutEngine``.

Programs that drive the model themselves (a ``verifiers`` environment: ``rollout.agents.verifiers_env``) send prompt token
ids and get back the sampled ids and their logprobs, the wire ``renderers.client.generate`` (prime-rl's renderer
client) speaks:

- ``POST {base}/inference/v1/generate`` with ``{"model", "token_ids": [int], "sampling_params": {...}}`` answers
  ``{"request_id", "prompt_token_ids", "choices": [{"index": 0, "token_ids", "finish_reason",
  "logprobs": {"content": [{"token": "token_id:<id>", "logprob"}]}}]}``;
- ``GET {base}/v1/models`` answers the model card with ``max_model_len`` (the client's prompt-length check).

Each episode gets its own path prefix ``/e/<key>`` (``open``), so every call is attributed to its episode by the URL
alone, and the server records what the engine produced for it (``close`` returns the calls). The server samples with
the recipe's temperature and top-p whatever the request asks (the learner's logprobs assume them); it takes
``max_tokens`` and ``seed`` from the request within the recipe's budget. Bad requests get a 4xx with an
OpenAI-style ``{"error": {"message"}}`` body naming the bad value; the engine never sees them.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gyre.rollout.config import SamplingConfig
from gyre.rollout.types import Sample


@dataclass(frozen=True)
class Call:
    """One generate call: the prompt the program sent and what the engine sampled for it."""

    prompt_token_ids: list[int]
    """[P] the request's ``token_ids``."""
    sample: Sample


@dataclass
class _Episode:
    engine: Any
    sampling: SamplingConfig
    max_model_len: int
    seed: int | None
    calls: list[Call] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    failure: BaseException | None = None


class RequestError(ValueError):
    """A generate request gyre refuses; the message names the bad value and what was expected."""


def parse_request(body: Any, vocab_size: int) -> tuple[list[int], dict]:
    """``(token_ids, sampling_params)`` of a generate request body.

    Raises:
        RequestError: not a JSON object, ``token_ids`` not a non-empty list of ints in ``[0, vocab_size)``, or
            ``sampling_params`` not an object.
    """
    if not isinstance(body, dict):
        raise RequestError(f"request body is {type(body).__name__}; expected a JSON object")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"token_ids is {ids!r:.80}; expected a non-empty list of token ids")
    for i, t in enumerate(ids):
        if type(t) is not int or not 0 <= t < vocab_size:
            raise RequestError(f"token_ids[{i}] is {t!r:.40}; expected an int in [0, {vocab_size})")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise RequestError(f"sampling_params is {params!r:.80}; expected an object")
    return ids, params


def turn_sampling(params: dict, sampling: SamplingConfig, prompt_len: int, max_model_len: int) -> SamplingConfig:
    """The recipe's ``sampling`` with this request's token budget: ``min(max_tokens, sampling.max_new_tokens,
    max_model_len - prompt_len)``.

    Raises:
        RequestError: ``max_tokens`` not a positive int, or the prompt leaves no room below ``max_model_len``.
    """
    asked = params.get("max_tokens", params.get("max_completion_tokens"))
    if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
        raise RequestError(f"sampling_params.max_tokens is {asked!r:.40}; expected a positive int")
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(f"the prompt has {prompt_len} tokens; the engine's max_model_len is {max_model_len} "
                           "(rollout.engine.max_model_len), which leaves no room for a response")
    budget = min(sampling.max_new_tokens, room, asked or sampling.max_new_tokens)
    return sampling.model_copy(update={"max_new_tokens": budget})


def response_body(request_id: str, prompt: list[int], sample: Sample) -> dict:
    """The generate response for ``sample`` (``renderers.client.generate``'s expected shape)."""
    content = [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(sample.token_ids, sample.logprobs,
                                                                           strict=True)]
    return {"request_id": request_id, "prompt_token_ids": prompt,
            "choices": [{"index": 0, "token_ids": list(sample.token_ids), "finish_reason": sample.finish_reason,
                         "logprobs": {"content": content}}]}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=status)


class GenerateEndpoint:
    """An HTTP server on ``host`` (a free port) in front of the engines its episodes name (``open``).

    Args:
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        model_name: the model id the programs send (any is accepted); ``/v1/models`` shows it with the episode's
            ``max_model_len``, so a renderer checks prompt lengths before it sends them.
    """

    def __init__(self, vocab_size: int, model_name: str = "policy", host: str = "127.0.0.1") -> None:
        self.vocab_size, self.model_name, self.host = vocab_size, model_name, host
        self._episodes: dict[str, _Episode] = {}
        self._runner: web.AppRunner | None = None
        self._ids = itertools.count()
        self.port = 0

    async def start(self) -> None:
        """Listen on a free port of ``host``."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/e/{key}/inference/v1/generate", self._generate)
        app.router.add_get("/e/{key}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, engine, sampling: SamplingConfig, max_model_len: int, seed: int | None = None) -> tuple[str, str]:
        """A new episode: ``(key, base_url)``; the program's OpenAI ``base_url`` is ``base_url`` (it ends in
        ``/v1``). Its calls go to ``engine`` (``RolloutEngine``: ``generate``) with ``sampling`` (the recipe's:
        temperature, top-p, the per-turn token budget) within ``max_model_len`` tokens; the ``k``-th samples with
        seed ``seed + k`` (``None``: the engine's stream)."""
        key = uuid.uuid4().hex[:16]
        self._episodes[key] = _Episode(engine, sampling, max_model_len, seed)
        return key, f"http://{self.host}:{self.port}/e/{key}/v1"

    def close_episode(self, key: str) -> tuple[list[Call], list[str]]:
        """The episode's calls in the order they were answered, and the reasons of any refused request; later
        requests to its URL get 404.

        Raises:
            Exception: what the engine raised while answering one of the episode's calls (``EngineFailedError``).
        """
        episode = self._episodes.pop(key)
        if episode.failure is not None:
            raise episode.failure
        return episode.calls, episode.refused

    async def _models(self, request: web.Request) -> web.Response:
        episode = self._episodes.get(request.match_info["key"])
        if episode is None:
            return _error(404, f"no open episode {request.match_info['key']!r}")
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": "gyre", "max_model_len": episode.max_model_len}]})

    async def _generate(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        episode = self._episodes.get(key)
        if episode is None:
            return _error(404, f"no open episode {key!r} (closed, or never opened by this rollout)")
        try:
            try:
                body = await request.json()
            except ValueError as exc:
                raise RequestError(f"request body is not JSON ({exc})") from exc
            prompt, params = parse_request(body, self.vocab_size)
            sampling = turn_sampling(params, episode.sampling, len(prompt), episode.max_model_len)
        except RequestError as exc:
            episode.refused.append(str(exc))
            return _error(400, str(exc))
        turn = len(episode.calls)
        seed = None if episode.seed is None else episode.seed + turn
        request_id = f"vf-{key}-t{turn}-{next(self._ids)}"
        try:
            (sample,) = await episode.engine.generate(prompt, 1, sampling, request_id=request_id, seed=seed)
        except Exception as exc:  # the engine's fault, not the request's: the runner re-raises it
            episode.failure = exc
            return _error(500, f"the engine failed: {type(exc).__name__}: {exc}"[:2000])
        if self._episodes.get(key) is episode:
            episode.calls.append(Call(list(prompt), sample))
        return web.json_response(response_body(request_id, prompt, sample))
