"""kvgate as the endpoint picker of a real Envoy in front of real vLLM engines."""

from __future__ import annotations

import aiohttp
import pytest

from kvgate.loadtest.kit.envoy import PickerRoute, envoy_config, running_envoy
from tests.harness import running_gateway, wait_until
from tests.real.test_through_kvgate import chat, prefix_hits, streamed_text

pytestmark = pytest.mark.timeout(300)


async def test_next_turn_through_envoy_hits_the_engine_the_picker_chose(fresh_engines, envoy_binary):
    urls = [engine.url for engine in fresh_engines]
    async with running_gateway(endpoints=urls, picker_listen="127.0.0.1:0") as gw:
        await wait_until(lambda: gw.gateway.ready()[0] and gw.gateway.models_known(), timeout=20)
        route = PickerRoute((gw.server.picker.port,))
        async with running_envoy(envoy_binary, envoy_config(urls, route)) as envoy, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            gained = []
            for tenant in range(3):
                first = await session.post(envoy.url + "/v1/chat/completions", json=chat(tenant, ["Hi."]))
                assert first.status == 200, await first.text()
                hits_before, queries_before = await prefix_hits(session, fresh_engines)
                second = await session.post(envoy.url + "/v1/chat/completions", json=chat(tenant, ["Hi.", "More."]))
                assert second.status == 200
                hits_after, queries_after = await prefix_hits(session, fresh_engines)
                gained.append((hits_after - hits_before) / (queries_after - queries_before))
            body = chat(9, ["Tell me a story."], max_tokens=64, stream=True, ignore_eos=True)
            async with session.post(envoy.url + "/v1/chat/completions", json=body) as response:
                assert response.status == 200
                relayed = await response.read()
    assert sum(gained) / len(gained) >= 0.75, gained  # vLLM's own counters: the second turn found its prefix
    assert relayed.endswith(b"data: [DONE]\n\n") and streamed_text(relayed)
