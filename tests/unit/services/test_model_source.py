"""Models by Hugging Face Hub id: resolved once from a pre-populated local HF cache (no network), pinned to a
commit, carried into every service's config, fetched by commit on a node without the folder; an id that
cannot be had (offline and not cached, unknown, gated, no such revision) is one clear line, and a dry run
downloads nothing. The unknown/gated cases answer from a loopback server standing in for the Hub's API."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gyre.utils.model_source import ModelSourceError, is_hub_id, localize, resolve
from gyre.services.control.recipe.schema import RecipeError, load_recipe
from tests.hf_cache import TINY_ID, populate_hf_cache, use_hf_cache

RECIPE = "deploy/recipes/tiny-test.yaml"


@pytest.fixture
def hub_cache(tiny_llama, tmp_path, monkeypatch):
    """An HF cache holding the tiny Llama as ``gyre-test/tiny-llama``, offline; yields its commit."""
    cache = tmp_path / "hf-cache"
    commit = populate_hf_cache(cache, TINY_ID, tiny_llama)
    use_hf_cache(monkeypatch, cache)
    return commit


def test_hub_id_form():
    assert is_hub_id("Qwen/Qwen2.5-1.5B-Instruct") and is_hub_id("org/name.v2")
    assert not is_hub_id("just-a-name") and not is_hub_id("/abs/path") and not is_hub_id("a/b/c")
    assert not is_hub_id("./rel/path") and not is_hub_id("../x")


def test_recipe_with_hub_id_resolves_from_the_cache_and_pins_the_commit(hub_cache, tmp_path):
    recipe = load_recipe(RECIPE, {"model": TINY_ID, "run_dir": str(tmp_path)})
    assert recipe.model_id == TINY_ID and recipe.model_revision == hub_cache
    assert recipe.model.endswith(f"snapshots/{hub_cache}")
    for engine in (recipe.rollout.engine, recipe.learner.engine):  # every service gets the same commit
        assert (engine.model, engine.model_id, engine.model_revision) == (recipe.model, TINY_ID, hub_cache)
    pinned = load_recipe(RECIPE, {"model": TINY_ID, "model_revision": hub_cache, "run_dir": str(tmp_path)})
    assert pinned.model == recipe.model


def test_a_node_without_the_folder_fetches_the_same_commit(hub_cache, tmp_path):
    from gyre.learner.config import LearnerConfig
    from gyre.rollout.config import EngineConfig

    elsewhere = str(tmp_path / "driver-only" / "snapshot")  # the driver's path, absent on this "node"
    for cls in (EngineConfig, LearnerConfig):
        cfg = cls(model=elsewhere, model_id=TINY_ID, model_revision=hub_cache)
        assert cfg.model.endswith(f"models--gyre-test--tiny-llama/snapshots/{hub_cache}")
    assert localize(elsewhere, None, None) == elsewhere  # a plain folder config is left alone


def test_offline_and_not_cached_is_one_line_naming_the_model_and_the_fix(hub_cache, tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPE, {"model": "nobody/not-cached", "run_dir": str(tmp_path)})
    text = str(err.value)
    assert "'nobody/not-cached' is not in the HF cache" in text and "HF_HUB_OFFLINE is set" in text
    assert "hf download nobody/not-cached" in text and "\n" not in text


def test_dry_run_downloads_nothing_and_keeps_the_id(hub_cache, tmp_path):
    recipe = load_recipe(RECIPE, {"model": "nobody/not-cached", "run_dir": str(tmp_path)}, dry_run=True)
    assert recipe.model == "nobody/not-cached" and recipe.model_id is None


def test_a_local_folder_with_a_revision_is_refused(tiny_llama, tmp_path):
    with pytest.raises(RecipeError, match=r"model_revision \('main'\) applies to a Hub id"):
        load_recipe(RECIPE, {"model": str(tiny_llama), "model_revision": "main", "run_dir": str(tmp_path)})


def test_model_id_in_a_recipe_is_refused(tiny_llama, tmp_path):
    with pytest.raises(RecipeError, match="model_id is set by the loader"):
        load_recipe(RECIPE, {"model": str(tiny_llama), "model_id": TINY_ID, "run_dir": str(tmp_path)})


class _FakeHub(BaseHTTPRequestHandler):
    """Answers every request as the Hub does for a missing or gated repository (its ``X-Error-Code``)."""

    code, error = 404, "RepoNotFound"
    seen: list[str] = []

    def _answer(self):
        _FakeHub.seen.append(self.path)
        self.send_response(self.code)
        self.send_header("X-Error-Code", self.error)
        self.send_header("Content-Type", "application/json")
        body = b'{"error": "stand-in"}'
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    use_hf_cache(monkeypatch, tmp_path / "empty-cache", offline=False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in_token_for_tests")  # no login prompt, no ~/.cache token read
    _FakeHub.seen = []
    yield _FakeHub
    server.shutdown()


@pytest.mark.parametrize("code,error,expect", [
    (404, "RepoNotFound", "was not found on the Hugging Face Hub: check the id"),
    (403, "GatedRepo", "is gated: accept its licence on https://huggingface.co/org/name and set HF_TOKEN"),
    (404, "RevisionNotFound", "has no revision 'v9'"),
])
def test_hub_errors_become_one_line_naming_the_model(fake_hub, code, error, expect):
    fake_hub.code, fake_hub.error = code, error
    with pytest.raises(ModelSourceError) as err:
        resolve("org/name", "v9" if error == "RevisionNotFound" else None)
    assert expect in str(err.value) and "\n" not in str(err.value)
    assert fake_hub.seen, "the stand-in Hub was asked"


def test_dry_run_never_asks_the_hub(fake_hub, tmp_path):
    load_recipe(RECIPE, {"model": "org/name", "run_dir": str(tmp_path)}, dry_run=True)
    assert fake_hub.seen == []


def test_a_dummy_weights_rollout_needs_only_the_config_and_tokenizer_on_its_node(tiny_llama, tmp_path, monkeypatch):
    """``rollout.engine.load_format: dummy``: a node whose HF cache holds the commit's config and tokenizer but no
    safetensors starts a rollout from them; a full rollout or a learner there still needs the weights."""
    import shutil

    from gyre.learner.config import LearnerConfig
    from gyre.rollout.config import EngineConfig

    config_only = tmp_path / "config-only"
    shutil.copytree(tiny_llama, config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    cache = tmp_path / "hf-cache"
    commit = populate_hf_cache(cache, TINY_ID, config_only)
    use_hf_cache(monkeypatch, cache)
    elsewhere = str(tmp_path / "driver-only" / "snapshot")
    cfg = EngineConfig(model=elsewhere, model_id=TINY_ID, model_revision=commit, load_format="dummy")
    assert cfg.model.endswith(f"snapshots/{commit}") and not list((tmp_path / "hf-cache").rglob("*.safetensors"))
    for make in (lambda: EngineConfig(model=elsewhere, model_id=TINY_ID, model_revision=commit),
                 lambda: LearnerConfig(model=elsewhere, model_id=TINY_ID, model_revision=commit)):
        with pytest.raises(ValueError, match="safetensors|not in the HF cache|could not be downloaded"):
            make()
