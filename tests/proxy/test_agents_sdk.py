"""The OpenAI Agents SDK (`openai-agents`) runs a tool loop against `anchorcache serve`:
`tool_choice="required"` forces a valid call on the first turn, the SDK runs the tool and
(resetting tool_choice, its default) the model answers: the run ends with a final output."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from anchorcache.cli import free_port, wait_ready

pytestmark = pytest.mark.slow


def test_agent_tool_loop_runs_to_completion(default_model_dir, tmp_path):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        ToolCallItem,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        cities.append(city)
        return f"sunny, 22 C in {city}"

    async def run(url: str):
        set_tracing_disabled(True)
        client = AsyncOpenAI(base_url=url + "/v1", api_key="", max_retries=0, timeout=300)
        agent = Agent(name="weather", instructions="You answer questions about the weather.",
                      tools=[get_weather],
                      model=OpenAIChatCompletionsModel(model="default", openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                   max_tokens=60))
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "anchorcache.cli", "serve", "--port", str(port),
                             "--threads", "2", "--log-level", "warning", "--state-dir", str(tmp_path)],
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout_s=300)
        result = asyncio.run(run(f"http://127.0.0.1:{port}"))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert cities == ["Paris"]
    assert isinstance(result.new_items[0], ToolCallItem)
    assert isinstance(result.final_output, str) and result.final_output
