"""The router's OpenAI-compatible HTTP API seen through the official `openai` Python client (and
vLLM's /tokenize and /detokenize, which the client does not call, over plain HTTP).

Run by tests/tests/it/openai.rs against routers it starts on loopback; exits non-zero (an
AssertionError or the client's own exception) on the first thing that is not as a user of the
client expects. Arguments (JSON on stdin):
  url, limited_url (no request admitted), deadline_url (1 ms deadline), down_url (no worker up),
  tools_url (renders prompts with a chat template that shows tools and teaches Hermes calls),
  model, alias (a second served name of url's router), completion_prompt, completion_text,
  chat_messages, chat_text, max_tokens,
  max_request_bytes (the router's body limit)
where completion_text / chat_text are the gRPC `Complete` answers for the same greedy requests.
"""

import json
import sys
import urllib.error
import urllib.request

import jsonschema
import openai

args = json.load(sys.stdin)
model = args["model"]
max_tokens = args["max_tokens"]


def client(url):
    # No retries: the error cases must be seen as they are answered.
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


main = client(args["url"])


def check_usage(usage, completion_tokens):
    assert usage.completion_tokens == completion_tokens, usage
    assert usage.prompt_tokens > 0, usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
    assert usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens, usage
    return usage


# Models: every served name, and a request by the alias answered under that name.
models = main.models.list()
assert [m.id for m in models.data] == [model, args["alias"]], models
by_alias = main.completions.create(
    model=args["alias"], prompt=args["completion_prompt"], max_tokens=max_tokens, temperature=0
)
assert by_alias.model == args["alias"], by_alias
assert by_alias.choices[0].text == args["completion_text"], by_alias

# Completions, whole: greedy text equals gRPC Complete.
whole = main.completions.create(
    model=model, prompt=args["completion_prompt"], max_tokens=max_tokens, temperature=0
)
assert whole.object == "text_completion", whole
assert whole.choices[0].text == args["completion_text"], (whole.choices[0].text, args)
assert whole.choices[0].finish_reason in ("stop", "length"), whole
check_usage(whole.usage, whole.usage.completion_tokens)

# Completions, streamed, with usage: the chunks add up to the same text.
chunks = list(
    main.completions.create(
        model=model,
        prompt=args["completion_prompt"],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
)
text = "".join(c.choices[0].text for c in chunks if c.choices)
assert text == args["completion_text"], (text, args)
assert chunks[-1].choices == [] and chunks[-1].usage is not None, chunks[-1]
assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == whole.choices[0].finish_reason
check_usage(chunks[-1].usage, whole.usage.completion_tokens)

# Completions with logprobs: one entry per token, the asked number of alternatives.
lp = main.completions.create(
    model=model, prompt=args["completion_prompt"], max_tokens=4, temperature=0, logprobs=3
)
logprobs = lp.choices[0].logprobs
assert len(logprobs.tokens) == lp.usage.completion_tokens, logprobs
assert all(len(t) == 3 for t in logprobs.top_logprobs), logprobs
assert all(x <= 0 for x in logprobs.token_logprobs), logprobs

# Chat, whole, twice: the second finds its prompt's prefix cached.
chat_args = dict(model=model, messages=args["chat_messages"], max_tokens=max_tokens, temperature=0)
first = main.chat.completions.create(**chat_args)
assert first.object == "chat.completion", first
assert first.choices[0].message.role == "assistant", first
assert first.choices[0].message.content == args["chat_text"], (first, args)
again = main.chat.completions.create(**chat_args)
assert again.choices[0].message.content == args["chat_text"], again
assert check_usage(again.usage, first.usage.completion_tokens).prompt_tokens_details.cached_tokens > 0, again.usage

# Chat, streamed: role first, then the text; no usage chunk unless asked for.
chunks = list(main.chat.completions.create(stream=True, **chat_args))
assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
assert "".join(c.choices[0].delta.content or "" for c in chunks) == args["chat_text"], chunks
assert chunks[-1].choices[0].finish_reason == first.choices[0].finish_reason, chunks[-1]
assert all(c.usage is None for c in chunks), chunks
chunks = list(
    main.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat_args)
)
check_usage(chunks[-1].usage, first.usage.completion_tokens)

# Chat with logprobs and the newer max_completion_tokens.
lp = main.chat.completions.create(
    model=model,
    messages=args["chat_messages"],
    max_completion_tokens=3,
    temperature=0,
    logprobs=True,
    top_logprobs=2,
    seed=7,
)
content = lp.choices[0].logprobs.content
assert len(content) == lp.usage.completion_tokens <= 3, lp
assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content), content


def expect(exception, status, call, **kwargs):
    try:
        call(**kwargs)
    except exception as e:
        assert e.status_code == status, (e.status_code, status, e)
        body = e.body
        assert isinstance(body, dict) and body.get("message"), body
        return e
    raise AssertionError(f"{call} {kwargs}: no {exception.__name__}")


create = main.chat.completions.create
msgs = args["chat_messages"]
# 400: what gRPC calls INVALID_ARGUMENT, and what only this front refuses.
e = expect(openai.BadRequestError, 400, create, model=model, messages=msgs, n=2)
assert e.body["param"] == "n", e.body
expect(openai.BadRequestError, 400, create, model=model, messages=msgs, temperature=-1)
expect(openai.BadRequestError, 400, create, model=model, messages=msgs, max_tokens=0)
expect(openai.BadRequestError, 400, create, model=model, messages=msgs, top_p=0)
expect(openai.BadRequestError, 400, main.completions.create, model=model, prompt="", max_tokens=1)
expect(openai.BadRequestError, 400, create, model=model, messages=msgs, stream=True, max_tokens=0)
# 404: an unknown model.
e = expect(openai.NotFoundError, 404, create, model="no-such-model", messages=msgs)
assert e.body["code"] == "model_not_found", e.body
# 429 with Retry-After: RESOURCE_EXHAUSTED.
limited = client(args["limited_url"])
e = expect(openai.RateLimitError, 429, limited.chat.completions.create, model=model, messages=msgs)
assert e.response.headers["retry-after"] == "1", e.response.headers
# 503: UNAVAILABLE.
down = client(args["down_url"])
expect(openai.InternalServerError, 503, down.chat.completions.create, model=model, messages=msgs)
expect(openai.InternalServerError, 503, down.completions.create, model=model, prompt="Hi", stream=True)
# 504: DEADLINE_EXCEEDED, whole and streamed.
late = client(args["deadline_url"])
expect(openai.InternalServerError, 504, late.chat.completions.create, model=model, messages=msgs)
expect(
    openai.InternalServerError, 504, late.chat.completions.create, model=model, messages=msgs, stream=True
)


# Structured outputs. A schema-held answer parses and validates, whole and streamed; json_object
# gives an object; a tool call names the tool, its arguments validate against the tool's schema,
# whole and streamed, and the call and its result go back into the conversation; bad constraints
# are 400.
person = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
describe = [{"role": "user", "content": "Describe a fictional person as JSON."}]
person_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}
held = create(model=model, messages=describe, max_tokens=200, temperature=0, response_format=person_format)
assert held.choices[0].finish_reason == "stop", held
jsonschema.validate(json.loads(held.choices[0].message.content), person)
streamed = create(
    model=model, messages=describe, max_tokens=200, temperature=0.8, seed=5, response_format=person_format,
    stream=True,
)
text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
jsonschema.validate(json.loads(text), person)
anything = create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
    max_tokens=100,
    temperature=0,
    response_format={"type": "json_object"},
)
assert anything.choices[0].finish_reason == "stop", anything
assert isinstance(json.loads(anything.choices[0].message.content), dict), anything
weather = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": weather}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
for choice in [{"type": "function", "function": {"name": "get_weather"}}, "required"]:
    r = create(model=model, messages=ask, tools=tools, tool_choice=choice, max_tokens=100, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls", r
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "function" and call.id, call
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), weather)
    else:
        assert call.function.name == "get_time" and isinstance(json.loads(call.function.arguments), dict), call
    # Streamed: the first delta names the call, the arguments arrive in pieces that join to the
    # same call, and the stream finishes with tool_calls.
    chunks = [
        c
        for c in create(
            model=model, messages=ask, tools=tools, tool_choice=choice, max_tokens=100, temperature=0, stream=True
        )
        if c.choices
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls", chunks[-1]
    assert not any(c.choices[0].delta.content for c in chunks), chunks
    first, *rest = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert first.id.startswith("call_") and first.type == "function" and first.function.name == call.function.name, first
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest), rest
    arguments = first.function.arguments + "".join(d.function.arguments for d in rest)
    assert json.loads(arguments) == json.loads(call.function.arguments), (arguments, call)
    answered = create(
        model=model,
        messages=ask
        + [r.choices[0].message.model_dump(exclude_none=True),
           {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}],
        max_tokens=16,
        temperature=0,
    )
    assert answered.choices[0].message.content, answered
# tool_choice "auto", the default with tools: the default model's template does not show tools,
# so its router refuses auto and says why. A router rendering with a template that shows them
# (--chat-template) serves it: whatever the model decides, text or calls of the offered tools
# whose arguments validate (the grammar holds them), streamed as answered whole; and a
# conversation's calls and results reach that template.
for kwargs in [{"tool_choice": "auto"}, {}]:
    e = expect(openai.BadRequestError, 400, create, model=model, messages=ask, tools=tools, **kwargs)
    assert "does not show the model the tools" in e.body["message"] and e.body["param"] == "tool_choice", e
auto = client(args["tools_url"]).chat.completions.create
weather_now = [{"role": "user", "content": "Call get_weather for Paris in celsius."}]
whole = auto(model=model, messages=weather_now, tools=tools, max_tokens=60, temperature=0).choices[0]
if whole.message.tool_calls:
    assert whole.finish_reason == "tool_calls", whole
    for call in whole.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time"), call
        jsonschema.validate(json.loads(call.function.arguments), weather if call.function.name == "get_weather" else {})
else:
    assert whole.finish_reason in ("stop", "length") and whole.message.content, whole
chunks = [
    c
    for c in auto(model=model, messages=weather_now, tools=tools, max_tokens=60, temperature=0, stream=True)
    if c.choices
]
assert chunks[-1].choices[0].finish_reason == whole.finish_reason, (chunks[-1], whole)
streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks)
assert streamed_text == (whole.message.content or ""), (streamed_text, whole)
streamed_calls = {}
for delta in [d for c in chunks for d in c.choices[0].delta.tool_calls or []]:
    if delta.id:
        streamed_calls[delta.index] = [delta.id, delta.function.name, delta.function.arguments]
    else:
        streamed_calls[delta.index][2] += delta.function.arguments
assert list(streamed_calls.values()) == [
    [c.id, c.function.name, c.function.arguments] for c in whole.message.tool_calls or []
], (streamed_calls, whole)
called = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Paris", "unit": "celsius"}'}}]}
result = {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}
with_calls = auto(model=model, messages=weather_now + [called, result], tools=tools, max_tokens=1)
without = auto(model=model, messages=weather_now + [{"role": "assistant", "content": ""}], tools=tools, max_tokens=1)
# The call (name and arguments) and the result, in <tool_call> and <tool_response> blocks.
assert with_calls.usage.prompt_tokens > without.usage.prompt_tokens + 20, (with_calls.usage, without.usage)
expect(openai.BadRequestError, 400, auto, model=model, messages=weather_now + [called, {"role": "tool", "content": "x"}])
for bad in [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"extra_body": {"guided_grammar": "start: missing_rule"}},
]:
    expect(openai.BadRequestError, 400, create, model=model, messages=describe, **bad)


def raw(url, body, content_type="application/json", method="POST"):
    req = urllib.request.Request(url, data=body, method=method)
    if content_type:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


chat_url = args["url"] + "/v1/chat/completions"
# Malformed JSON, a wrong content type, a body of the wrong shape, an oversized body: 4xx in
# the envelope, and the server keeps serving.
for body, content_type, want in [
    (b'{"model": ', "application/json", 400),
    (json.dumps(chat_args).encode(), "text/plain", 415),
    (b'{"model": "x"}', "application/json", 422),
    (b'{"model": "' + b"x" * args["max_request_bytes"] + b'"}', "application/json", 413),
]:
    status, text = raw(chat_url, body, content_type)
    assert status == want, (status, want, text[:200])
    assert json.loads(text)["error"]["message"], text
assert create(**chat_args).choices[0].message.content == args["chat_text"]

# vLLM's /tokenize and /detokenize, and a prompt of token ids: the completion prompt's tokens
# answer as its text does (through the official client) and detokenize back to it; a chat's
# tokens are those its completion counted, special tokens named; bad input is 400 naming the field.
def post_json(path, body):
    status, text = raw(args["url"] + path, json.dumps(body).encode())
    return status, json.loads(text)


status, tok = post_json("/tokenize", {"model": model, "prompt": args["completion_prompt"]})
assert status == 200 and tok["count"] == len(tok["tokens"]) > 0 and tok["token_strs"] is None, tok
assert tok["max_model_len"] > tok["count"], tok
by_ids = main.completions.create(model=model, prompt=tok["tokens"], max_tokens=max_tokens, temperature=0)
assert by_ids.choices[0].text == args["completion_text"], (by_ids, args)
assert by_ids.usage.prompt_tokens == tok["count"], by_ids.usage
status, back = post_json("/detokenize", {"model": model, "tokens": tok["tokens"]})
assert status == 200 and back["prompt"].endswith(args["completion_prompt"]), back
status, chat_tok = post_json(
    "/tokenize", {"model": model, "messages": args["chat_messages"], "return_token_strs": True}
)
assert status == 200 and chat_tok["count"] == again.usage.prompt_tokens, (chat_tok, again.usage)
assert len(chat_tok["token_strs"]) == chat_tok["count"] and "<|im_start|>" in chat_tok["token_strs"], chat_tok
for path, body, param in [
    ("/tokenize", {"model": model}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": args["chat_messages"]}, "messages"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
]:
    status, e = post_json(path, body)
    assert status == 400 and e["error"]["param"] == param and e["error"]["message"], (path, body, e)
e = expect(openai.BadRequestError, 400, main.completions.create, model=model, prompt=[1, 10**9], max_tokens=1)
assert e.body["param"] == "prompt" and "prompt[1]" in e.body["message"], e.body

# Health and liveness.
assert raw(args["url"] + "/health", None, None, "GET")[0] == 200
assert raw(args["down_url"] + "/health", None, None, "GET")[0] == 503
assert raw(args["down_url"] + "/live", None, None, "GET")[0] == 200

print("openai conformance: all checks passed")
