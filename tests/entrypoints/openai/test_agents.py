"""openai-agents on its default path (the Responses API, a model given by name) against a
live server: an agent calls a function tool, reads its result and answers; streamed too."""

import asyncio

import openai
import pytest

from tests.entrypoints.openai.conftest import MODEL


@pytest.fixture
def configured(server):
    """A client of this test's own: each test runs in its own event loop."""
    agents = sdk()
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=server.base_url,
                                                        api_key="none", max_retries=0),
                                     use_for_tracing=False)
    agents.set_default_openai_api("responses")
    agents.set_tracing_disabled(True)


def sdk():
    """openai-agents, imported on first use (not at collection: its import takes 2 s of
    every test worker)."""
    return pytest.importorskip("agents")


def weather_agent(calls: list[str]):
    agents = sdk()
    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny, 21 C in {city}."

    return agents.Agent(name="forecaster", instructions="Answer with the weather.",
                        model=MODEL, tools=[get_weather],
                        model_settings=agents.ModelSettings(tool_choice="required",
                                                            temperature=0, max_tokens=64))


def test_an_agent_calls_its_tool_and_answers(configured):
    agents = sdk()
    calls: list[str] = []
    result = asyncio.run(agents.Runner.run(weather_agent(calls), "Weather in Paris?",
                                           max_turns=4))
    assert len(calls) >= 1 and all(isinstance(c, str) and c for c in calls)
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds
    assert isinstance(result.final_output, str) and result.final_output
    assert result.raw_responses[0].output[0].type == "function_call"


def test_a_streamed_agent_run(configured):
    calls: list[str] = []

    agents = sdk()

    async def run() -> tuple[object, list[str]]:
        streamed = agents.Runner.run_streamed(weather_agent(calls), "Weather in Rome?",
                                              max_turns=4)
        kinds = [event.type async for event in streamed.stream_events()]
        return streamed, kinds

    streamed, kinds = asyncio.run(run())
    assert calls and "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert isinstance(streamed.final_output, str) and streamed.final_output
