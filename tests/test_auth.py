"""API keys and rate limits: the keys file, reloading it, the 401/429 answers, and secrets kept out of logs."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest
import yaml
from aiohttp import web
from multidict import CIMultiDict

from kvgate.simulator import SimFleet, SimOptions
from kvgate.policies.config import RoutingConfig
from kvgate.router.auth import ApiKeyStore, KeyInfo, KeysFileError, bearer_token, parse_keys
from kvgate.router.config import ConfigError
from kvgate.router.errors import GatewayError
from kvgate.router.ratelimit import RateLimiter, estimate_tokens
from kvgate.router.requests import InferenceRequest, parse_request
from tests.harness import FakeClock, running_gateway, scripted_replica, wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ROOT = Path(__file__).resolve().parent.parent
# Distinctive secrets, so that any leak into logs or metrics is found by a plain substring search.
ALICE_SECRET = "sk-alice-0123456789abcdef0123"
BOB_SECRET = "sk-bob-fedcba9876543210fedcba"  # configured only as its sha256 digest
WRONG_SECRET = "sk-wrong-00000000000000000000"
LATER_SECRET = "sk-later-1111111111111111111111"
BOB_DIGEST = "sha256:" + hashlib.sha256(BOB_SECRET.encode()).hexdigest()
SECRETS = (ALICE_SECRET, BOB_SECRET, WRONG_SECRET, LATER_SECRET, BOB_DIGEST[len("sha256:"):])
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 4}


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def write_keys(path: Path, entries: list[dict]) -> Path:
    return write_text(path, yaml.safe_dump(entries))


def standard_keys(directory: Path, **alice_limits: int) -> Path:
    return write_keys(directory / "keys.yaml", [
        {"name": "alice", "key": ALICE_SECRET, "priority": "interactive", **alice_limits},
        {"name": "bob", "key": BOB_DIGEST, "priority": "batch"},
    ])


def publish_secret_version(directory: Path, content: str, version: str) -> Path:
    """Lay out a directory as the kubelet does for a Secret volume and atomically switch `..data` to `content`."""
    version_dir = directory / f"..{version}"
    version_dir.mkdir()
    (version_dir / "keys.yaml").write_text(content)
    staging = directory / "..data_tmp"
    os.symlink(version_dir.name, staging)
    os.replace(staging, directory / "..data")
    visible = directory / "keys.yaml"
    if not visible.is_symlink():
        os.symlink("..data/keys.yaml", visible)
    return visible


def assert_openai_error(body: dict, status: int, error_type: str) -> None:
    assert set(body) == {"error"}
    assert body["error"]["type"] == error_type and body["error"]["code"] == status
    assert body["error"]["param"] is None and body["error"]["message"]


@pytest.fixture
async def sim() -> SimFleet:
    fleet = await SimFleet.start([0], SimOptions(speed=50.0))
    yield fleet
    await fleet.stop()


def forwarded_count(fleet: SimFleet) -> int:
    return sum(replica.stats()["requests"] for replica in fleet.replicas)


# The keys file


def test_keys_file_accepts_plaintext_and_sha256_keys_with_their_settings(tmp_path) -> None:
    store = ApiKeyStore(str(standard_keys(tmp_path, requests_per_minute=60, tokens_per_minute=9000)))
    assert store.authenticate(f"Bearer {ALICE_SECRET}") == KeyInfo("alice", "interactive", 60, 9000)
    assert store.authenticate(f"Bearer {BOB_SECRET}") == KeyInfo("bob", "batch", None, None)
    assert store.authenticate(f"Bearer {WRONG_SECRET}") is None
    assert store.authenticate(f"Bearer {BOB_DIGEST}") is None  # the digest itself is not a key
    assert store.authenticate(None) is None
    assert store.names == ["alice", "bob"]


@pytest.mark.parametrize(("value", "token"), [
    (f"Bearer {ALICE_SECRET}", ALICE_SECRET), (f"bearer   {ALICE_SECRET} ", ALICE_SECRET),
    ("Bearer", None), ("Bearer ", None), (f"Basic {ALICE_SECRET}", None), (ALICE_SECRET, None), ("", None),
    (None, None),
])
def test_only_a_bearer_authorization_presents_a_token(value, token) -> None:
    assert bearer_token(value) == token


BAD_FILES = [
    ({"name": "alice", "key": ALICE_SECRET}, "must be a YAML list"),
    ([ALICE_SECRET], "entry 1: must be a mapping"),
    ([{"key": ALICE_SECRET}], "entry 1: 'name'"),
    ([{"name": "has space", "key": ALICE_SECRET}], "entry 1: 'name'"),
    ([{"name": "alice"}], "key 'alice': 'key' is required"),
    ([{"name": "alice", "key": 12345678901234567890}], "key 'alice': 'key' is required and must be a string"),
    ([{"name": "alice", "key": "sk-short"}], "too short"),
    ([{"name": "alice", "key": ALICE_SECRET + " x"}], "visible ASCII"),
    ([{"name": "alice", "key": "sha256:abc"}], "64 hex digits"),
    ([{"name": "alice", "key": ALICE_SECRET}, {"name": "alice", "key": BOB_SECRET}], "duplicate name 'alice'"),
    ([{"name": "alice", "key": BOB_SECRET}, {"name": "bob", "key": BOB_DIGEST}],
     "key 'bob': same secret as key 'alice'"),
    ([{"name": "alice", "key": ALICE_SECRET, "priority": "urgent"}], "priority must be one of interactive, batch"),
    ([{"name": "alice", "key": ALICE_SECRET, "requests_per_minute": 0}], "requests_per_minute: must be"),
    ([{"name": "alice", "key": ALICE_SECRET, "tokens_per_minute": "100"}], "tokens_per_minute: must be"),
    ([{"name": "alice", "key": ALICE_SECRET, "requests_per_minute": True}], "requests_per_minute: must be"),
    ([{"name": "alice", "key": ALICE_SECRET, "request_per_minute": 5}], "unknown field(s) request_per_minute"),
]


@pytest.mark.parametrize(("data", "message"), BAD_FILES)
def test_invalid_keys_file_is_refused_with_a_message_that_names_the_problem_but_no_secret(data, message) -> None:
    with pytest.raises(KeysFileError) as caught:
        parse_keys(data)
    assert message in str(caught.value)
    assert not any(secret in str(caught.value) for secret in SECRETS)
    assert isinstance(caught.value, ConfigError)


def test_unreadable_or_malformed_keys_file_fails_at_start_without_quoting_it(tmp_path) -> None:
    with pytest.raises(KeysFileError, match="cannot read"):
        ApiKeyStore(str(tmp_path / "absent.yaml"))
    broken = tmp_path / "broken.yaml"
    broken.write_text(f"- name: alice\n  key: {ALICE_SECRET}\n  - [unbalanced\n")
    with pytest.raises(KeysFileError, match="not valid YAML at line 3") as caught:
        ApiKeyStore(str(broken))
    assert ALICE_SECRET not in str(caught.value)


def test_the_example_in_the_security_docs_is_a_valid_keys_file(tmp_path) -> None:
    docs = (ROOT / "docs/security.md").read_text()
    example = docs.split("```yaml\n", 1)[1].split("```", 1)[0]
    store = ApiKeyStore(str(write_text(tmp_path / "keys.yaml", example)))
    assert store.names == ["nightly-evals", "search-frontend"]
    assert store.authenticate("Bearer example-key-do-not-use-0000000000") == KeyInfo("nightly-evals", "batch")


def test_an_empty_keys_file_refuses_every_key(tmp_path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("")
    store = ApiKeyStore(str(path))
    assert store.names == [] and store.authenticate(f"Bearer {ALICE_SECRET}") is None


# Reloading


def test_edited_file_is_reloaded_and_a_bad_edit_keeps_the_previous_keys(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.router.auth")
    path = standard_keys(tmp_path)
    store = ApiKeyStore(str(path))
    assert store.reload_if_changed() is False
    write_keys(path, [{"name": "later", "key": LATER_SECRET}])
    assert store.reload_if_changed() is True
    assert store.authenticate(f"Bearer {LATER_SECRET}") == KeyInfo("later")
    assert store.authenticate(f"Bearer {ALICE_SECRET}") is None
    assert "added=later removed=alice,bob" in caplog.text

    write_keys(path, [{"name": "later", "key": LATER_SECRET}, {"name": "later", "key": ALICE_SECRET}])
    assert store.reload_if_changed() is False
    assert store.reload_if_changed() is False  # the same bad version is not re-read, nor reported again
    assert store.authenticate(f"Bearer {LATER_SECRET}") == KeyInfo("later")
    assert caplog.text.count("api keys reload rejected") == 1
    assert "duplicate name 'later'" in caplog.text

    path.unlink()
    assert store.reload_if_changed() is False
    assert store.authenticate(f"Bearer {LATER_SECRET}") == KeyInfo("later")
    assert not any(secret in caplog.text for secret in SECRETS)


def test_secret_volume_symlink_swap_is_reloaded_and_an_identical_swap_is_not(tmp_path) -> None:
    first = yaml.safe_dump([{"name": "alice", "key": ALICE_SECRET}])
    path = publish_secret_version(tmp_path, first, "2025_01_01_00_00_00.1")
    store = ApiKeyStore(str(path))
    publish_secret_version(tmp_path, first, "2025_01_01_00_01_00.2")
    assert store.reload_if_changed() is False  # a new inode with the same content changes nothing
    publish_secret_version(tmp_path, yaml.safe_dump([{"name": "bob", "key": BOB_DIGEST}]), "2025_01_01_00_02_00.3")
    assert store.reload_if_changed() is True
    assert store.authenticate(f"Bearer {BOB_SECRET}") == KeyInfo("bob")
    assert store.authenticate(f"Bearer {ALICE_SECRET}") is None


async def test_running_store_picks_up_a_changed_file_within_its_poll_interval(tmp_path) -> None:
    path = standard_keys(tmp_path)
    store = ApiKeyStore(str(path), poll_s=0.02)
    task = asyncio.create_task(store.run())
    try:
        write_keys(path, [{"name": "later", "key": LATER_SECRET}])
        await wait_until(lambda: store.authenticate(f"Bearer {LATER_SECRET}") is not None, timeout=2.0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()


# Rate limits


def test_requests_per_minute_allows_a_burst_then_one_request_per_interval() -> None:
    clock = FakeClock()
    limiter = RateLimiter(clock)
    key = KeyInfo("alice", requests_per_minute=2)
    assert limiter.check(key, 0) is None
    assert limiter.check(key, 0) is None
    assert limiter.check(key, 0) == pytest.approx(30.0)
    clock.now += 29.0
    assert limiter.check(key, 0) == pytest.approx(1.0)
    clock.now += 1.001
    assert limiter.check(key, 0) is None
    assert limiter.check(KeyInfo("bob", requests_per_minute=2), 0) is None  # keys have their own buckets
    assert limiter.check(KeyInfo("carol"), 10**9) is None  # no limits, no waiting


def test_tokens_per_minute_waits_for_the_missing_tokens_and_a_refused_request_takes_nothing() -> None:
    clock = FakeClock()
    limiter = RateLimiter(clock)
    key = KeyInfo("alice", requests_per_minute=3, tokens_per_minute=600)  # 10 tokens/s
    assert limiter.check(key, 500) is None
    assert limiter.check(key, 300) == pytest.approx(20.0)
    assert limiter.check(key, 100) is None  # the refused request used neither budget
    assert limiter.check(key, 0) is None
    assert limiter.check(key, 0) == pytest.approx(20.0)  # now the request budget binds
    clock.now += 60.0
    assert limiter.check(key, 5000) is None  # larger than a minute's budget: passes on a full bucket
    assert limiter.check(key, 1) == pytest.approx(0.1)


def test_a_lowered_limit_applies_at_once() -> None:
    clock = FakeClock()
    limiter = RateLimiter(clock)
    assert limiter.check(KeyInfo("alice", requests_per_minute=100), 0) is None
    assert limiter.check(KeyInfo("alice", requests_per_minute=1), 0) is None
    assert limiter.check(KeyInfo("alice", requests_per_minute=1), 0) == pytest.approx(60.0)


def test_admit_raises_an_openai_rate_limit_error_with_whole_seconds_to_wait() -> None:
    clock = FakeClock()
    limiter = RateLimiter(clock)
    key = KeyInfo("alice", requests_per_minute=60, tokens_per_minute=60)
    limiter.admit(key, 59)
    with pytest.raises(GatewayError) as caught:
        limiter.admit(key, 10)
    error = caught.value
    assert error.status == 429 and error.headers == {"Retry-After": "9"}  # 9 missing tokens at 1 per second
    assert "'alice'" in error.message and "60 tokens per minute" in error.message


def parsed(kind: str, body: dict) -> InferenceRequest:
    return parse_request(f"/v1/{'chat/completions' if kind == 'chat' else 'completions'}", orjson.dumps(body),
                         "interactive", 0, RoutingConfig())


@pytest.mark.parametrize(("kind", "body", "tokens"), [
    ("completion", {"model": "m", "prompt": "x" * 400}, 100),
    ("completion", {"model": "m", "prompt": "x" * 401, "max_tokens": 50}, 151),
    ("completion", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 10, "n": 3}, 33),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 999,
              "max_completion_tokens": 20}, 20),
    ("completion", {"model": "m", "prompt": "", "max_tokens": "lots", "n": -1}, 0),
])
def test_request_tokens_are_the_estimated_prompt_plus_the_requested_completions(kind, body, tokens) -> None:
    estimate = estimate_tokens(parsed(kind, body))
    # Chat prompts also count the serialized role; the completion part is what must be exact.
    assert estimate == tokens if kind == "completion" else tokens < estimate <= tokens + 20


# Through the gateway (needs the wiring described in docs/security.md: middleware, limiter, forwardable)


async def test_inference_and_models_need_a_valid_key_while_probes_and_metrics_do_not(sim, tmp_path) -> None:
    keys = standard_keys(tmp_path)
    async with running_gateway(endpoints=sim.urls, api_keys_file=str(keys)) as gw, \
            aiohttp.ClientSession() as client:
        for headers, message in (({}, "an API key is required"), (bearer(WRONG_SECRET), "invalid API key"),
                                 ({"Authorization": f"Basic {ALICE_SECRET}"}, "invalid API key")):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers) as resp:
                assert resp.status == 401
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
                body = await resp.json()
            assert_openai_error(body, 401, "AuthenticationError")
            assert message in body["error"]["message"]
        async with client.get(gw.url + "/v1/models") as resp:
            assert resp.status == 401
        async with client.get(gw.url + "/v1/models", headers=bearer(BOB_SECRET)) as resp:
            assert resp.status == 200
        for path in ("/healthz", "/readyz", "/metrics", "/debug/fleet"):
            async with client.get(gw.url + path) as resp:
                assert resp.status == 200, path
        async with client.get(gw.url + "/v1/unknown") as resp:
            assert resp.status == 401  # closed by default: only the listed routes are open
        async with client.get(gw.url + "/v1/unknown", headers=bearer(ALICE_SECRET)) as resp:
            assert resp.status == 404
        assert forwarded_count(sim) == 0
        sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=ALICE_SECRET, max_retries=0)
        completion = await sdk.chat.completions.create(**CHAT)
        wrong = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=WRONG_SECRET, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(**CHAT)
        await sdk.close()
        await wrong.close()
        async with client.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    assert completion.choices[0].message.content
    assert forwarded_count(sim) == 1
    # Without a header: the chat, /v1/models and /v1/unknown; with a wrong one: two chats and the SDK's.
    assert 'kvgate_auth_failures_total{reason="missing"} 3.0' in metrics
    assert 'kvgate_auth_failures_total{reason="invalid"} 3.0' in metrics


async def test_the_key_reaches_no_replica_when_the_gateway_checks_it(tmp_path) -> None:
    seen: list[CIMultiDict[str]] = []

    async def echo(request: web.Request) -> web.Response:
        seen.append(CIMultiDict(request.headers))
        return web.json_response({"ok": True})

    body = {"model": "m", "prompt": "x"}
    async with scripted_replica([("POST", "/v1/completions", echo)]) as url, aiohttp.ClientSession() as client:
        async with running_gateway(endpoints=[url], api_keys_file=str(standard_keys(tmp_path))) as gw:
            async with client.post(gw.url + "/v1/completions", json=body, headers=bearer(ALICE_SECRET)) as resp:
                assert resp.status == 200
        async with running_gateway(endpoints=[url]) as gw:  # off: the replica may check keys of its own
            async with client.post(gw.url + "/v1/completions", json=body, headers=bearer(ALICE_SECRET)) as resp:
                assert resp.status == 200
    assert len(seen) == 2
    assert "Authorization" not in seen[0]
    assert seen[1]["Authorization"] == f"Bearer {ALICE_SECRET}"


async def test_a_key_over_its_limit_gets_429_with_retry_after_and_other_keys_are_unaffected(sim, tmp_path) -> None:
    keys = standard_keys(tmp_path, requests_per_minute=2)
    async with running_gateway(endpoints=sim.urls, api_keys_file=str(keys)) as gw, \
            aiohttp.ClientSession() as client:
        statuses = []
        for _ in range(2):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT, headers=bearer(ALICE_SECRET)) as resp:
                statuses.append(resp.status)
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT, headers=bearer(ALICE_SECRET)) as resp:
            limited_status, retry_after, limited = resp.status, resp.headers.get("Retry-After"), await resp.json()
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT, headers=bearer(BOB_SECRET)) as resp:
            statuses.append(resp.status)
    assert statuses == [200, 200, 200]
    assert limited_status == 429 and 1 <= int(retry_after) <= 30
    assert_openai_error(limited, 429, "RateLimitError")
    assert forwarded_count(sim) == 3


async def test_keys_file_changes_apply_to_a_running_gateway(sim, tmp_path) -> None:
    keys = standard_keys(tmp_path)
    async with running_gateway(endpoints=sim.urls, api_keys_file=str(keys)) as gw, \
            aiohttp.ClientSession() as client:
        write_keys(keys, [{"name": "later", "key": LATER_SECRET}])
        status = 401
        for _ in range(40):  # the store polls about once a second
            async with client.get(gw.url + "/v1/models", headers=bearer(LATER_SECRET)) as resp:
                status = resp.status
            if status == 200:
                break
            await asyncio.sleep(0.1)
        async with client.get(gw.url + "/v1/models", headers=bearer(ALICE_SECRET)) as resp:
            revoked = resp.status
    assert status == 200 and revoked == 401


async def test_secrets_never_reach_logs_or_metrics(sim, tmp_path, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    keys = standard_keys(tmp_path, requests_per_minute=1)
    async with running_gateway(endpoints=sim.urls, api_keys_file=str(keys)) as gw, \
            aiohttp.ClientSession() as client:
        for secret in (WRONG_SECRET, ALICE_SECRET, ALICE_SECRET, BOB_SECRET, BOB_DIGEST):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT, headers=bearer(secret)) as resp:
                await resp.read()
        # A rejected reload whose bad entry holds a new secret must not quote it either.
        write_keys(keys, [{"name": "later", "key": LATER_SECRET}, {"name": "later", "key": LATER_SECRET + "x"}])
        await wait_until(lambda: "api keys reload rejected" in caplog.text, timeout=4.0)
        async with client.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    assert "auth rejected" in caplog.text and "status=429" in caplog.text and "kvgate_requests_total" in metrics
    for secret in SECRETS:
        assert secret not in caplog.text
        assert secret not in metrics


async def test_invalid_keys_file_stops_the_gateway_at_start(sim, tmp_path) -> None:
    keys = write_keys(tmp_path / "keys.yaml", [{"name": "alice", "key": "sk-short"}])
    with pytest.raises(ConfigError, match="too short"):
        async with running_gateway(endpoints=sim.urls, api_keys_file=str(keys)):
            pass


def test_cli_reports_an_invalid_keys_file_as_a_configuration_error(tmp_path) -> None:
    keys = write_keys(tmp_path / "keys.yaml", [{"name": "alice", "key": ALICE_SECRET},
                                               {"name": "bob", "key": ALICE_SECRET}])
    done = subprocess.run([sys.executable, "-m", "kvgate.router.cli", "serve", "--listen", "127.0.0.1:0",
                           "--endpoints", "http://127.0.0.1:9", "--api-keys-file", str(keys)],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "configuration error" in done.stderr and "same secret as key 'alice'" in done.stderr
    assert ALICE_SECRET not in done.stderr + done.stdout


# The admin port


@pytest.mark.parametrize("with_keys", [False, True])
async def test_with_an_admin_port_metrics_and_debug_leave_the_public_port(sim, tmp_path, with_keys) -> None:
    settings = {"api_keys_file": str(standard_keys(tmp_path))} if with_keys else {}
    async with running_gateway(endpoints=sim.urls, admin_listen="127.0.0.1:0", **settings) as gw, \
            aiohttp.ClientSession(headers=bearer(ALICE_SECRET)) as client:
        assert gw.admin_url != gw.url
        for path in ("/metrics", "/debug/fleet"):
            async with client.get(gw.url + path) as resp:
                assert resp.status == 404, path
            async with client.get(gw.admin_url + path, headers={"Authorization": ""}) as resp:
                assert resp.status == 200, path
        async with client.get(gw.admin_url + "/metrics") as resp:
            assert "kvgate_requests_total" in await resp.text()
        for base in (gw.url, gw.admin_url):
            async with client.get(base + "/readyz", headers={"Authorization": ""}) as resp:
                assert resp.status == 200
