"""A tool-call round trip on Qwen2.5-Coder-0.5B-Instruct (its template renders tools, the hermes format) through
`specdec serve`'s app and the real openai client: tool_choice "auto" and "required", streamed and not, then the
tool's result sent back for the final answer. Not a CI test (the model is a 478 MB download:
`python -m bench.models qwen-draft --dtype bfloat16`). Prints what each call returned.

    PYTHONPATH=.:tests python bench/experiments/20261128_qwen_tools/round_trip.py
"""

import json

from serve_helpers import ServerThread

from bench.models import QWEN_DRAFT, model_dir

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "the city name"}}}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def main() -> None:
    server = ServerThread(str(model_dir(QWEN_DRAFT.name, "bfloat16")), name="qwen", dtype="bfloat16",
                          max_model_len=2048, max_num_seqs=2).start()
    try:
        client = server.client()
        for choice in ("auto", "required"):
            got = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], tool_choice=choice,
                                                 temperature=0, max_tokens=100)
            c = got.choices[0]
            print(f"tool_choice={choice}: finish_reason={c.finish_reason} content={c.message.content!r} "
                  f"tool_calls={[t.function.model_dump() for t in c.message.tool_calls or []]}")
            stream = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], tool_choice=choice,
                                                    temperature=0, max_tokens=100, stream=True)
            calls = [tc.function.model_dump() for chunk in stream for ch in chunk.choices
                     for tc in ch.delta.tool_calls or []]
            print(f"  streamed: {calls}")
        call = c.message.tool_calls[0]
        history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id,
                          "content": json.dumps({"city": "Paris", "temperature_c": 21, "sky": "sunny"})}]
        for choice in ("auto", "none"):
            final = client.chat.completions.create(model="qwen", messages=history, tools=[WEATHER], temperature=0,
                                                   tool_choice=choice, max_tokens=60)
            c = final.choices[0]
            print(f"final (tool_choice={choice}): finish_reason={c.finish_reason} content={c.message.content!r} "
                  f"tool_calls={[t.function.model_dump() for t in c.message.tool_calls or []]}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
