"""Fixtures the serve tests share: the openai SDK on a module's `service` (a running
`kvserve serve` with its HTTP face, which each module starts its own way) and the served
model's name."""

from __future__ import annotations

import openai
import pytest

from tests.faults.harness import Service


@pytest.fixture(scope="module")
def client(service: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
