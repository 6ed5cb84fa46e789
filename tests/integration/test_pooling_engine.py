"""An engine that runs a pooling model: embeddings through the gateway, with the official SDK.

The tiny demo model served as an embedding model (vLLM's ``--runner pooling --convert embed``
after ``--``): vectors for the base model and for an adapter (which must change them: the
adapter's weights are applied), the public name in ``model``, and the generation routes
answered with an OpenAI-shaped error that says why instead of vLLM's bare "Not Found".
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.gateway_process import GatewayProcess

pytestmark = [pytest.mark.engine, pytest.mark.restarts]

BASE = "loragate-demo"


@pytest.fixture(scope="module")
def pooling(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        cache_dir=tmp_path_factory.mktemp("pooling"),
        args=["--", "--runner", "pooling", "--convert", "embed"],
    ).start()
    try:
        process.wait_ready(timeout=900)
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(pooling: GatewayProcess) -> OpenAI:
    return OpenAI(base_url=f"{pooling.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_embeddings_for_the_base_model_and_an_adapter(client: OpenAI) -> None:
    texts = ["The fox jumps.", "An owl hoots at night."]
    base = client.embeddings.create(model=BASE, input=texts)
    fox = client.embeddings.create(model="fox", input=texts)
    assert base.model == BASE and fox.model == "fox"
    assert [d.index for d in base.data] == [0, 1]
    size = len(base.data[0].embedding)
    assert size > 8 and all(len(d.embedding) == size for d in [*base.data, *fox.data])
    for item in base.data:
        assert math.isclose(math.fsum(x * x for x in item.embedding), 1.0, rel_tol=1e-3)
    assert base.data[0].embedding != base.data[1].embedding  # the text matters
    assert fox.data[0].embedding != base.data[0].embedding  # and so does the adapter
    again = client.embeddings.create(model="fox", input=texts[0])
    assert again.data[0].embedding == pytest.approx(fox.data[0].embedding, abs=1e-5)


def test_generation_routes_say_the_engine_runs_a_pooling_model(
    client: OpenAI, pooling: GatewayProcess
) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(
            model="fox", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "route_not_served", error
    assert "pooling model" in error["message"] and "/v1/embeddings" in error["message"]
    streamed = httpx.post(
        f"{pooling.url}/v1/completions",
        json={"model": BASE, "prompt": "hi", "max_tokens": 4, "stream": True},
        timeout=60,
    )
    assert streamed.status_code == 404
    assert streamed.json()["error"]["code"] == "route_not_served"


def test_an_unknown_model_is_still_a_clear_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        client.embeddings.create(model="nope", input="hi")
    assert "nope" in str(refused.value)
