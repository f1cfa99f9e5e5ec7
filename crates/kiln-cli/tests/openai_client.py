"""Drives a running `kiln serve` with the official openai client: chat and completions,
streaming and not. Usage: openai_client.py BASE_URL API_KEY. Prints OK at the end."""
import sys

import openai

base_url, api_key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0)

models = client.models.list()
model = models.data[0].id
assert model == "stories", model

messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Once upon a time"}]
chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
reply = chat.choices[0].message.content
assert chat.choices[0].finish_reason == "length", chat
assert chat.usage.completion_tokens == 12 and chat.usage.prompt_tokens > 0, chat.usage
assert reply, chat

stream = client.chat.completions.create(
    model=model, messages=messages, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
)
parts, finish, usage = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        finish = c.finish_reason or finish
assert "".join(parts) == reply, (parts, reply)
assert finish == "length" and usage.completion_tokens == 12, (finish, usage)

# Two choices, whole and streamed, each with its index.
two = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=1.0, seed=3, n=2)
assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 12, two
stream = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=1.0, seed=3, n=2, stream=True)
texts = ["", ""]
for chunk in stream:
    for c in chunk.choices:
        texts[c.index] += c.delta.content or ""
assert texts == [c.message.content for c in two.choices], (texts, two)

done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=2)
text = done.choices[0].text
assert done.usage.completion_tokens == 10 and len(done.choices[0].logprobs.tokens) == 10, done
stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True)
streamed = "".join(c.choices[0].text for c in stream if c.choices)
assert streamed == text, (streamed, text)

cached = client.completions.create(model=model, prompt=[1] + list(range(40, 120)), max_tokens=4, temperature=0)
cached = client.completions.create(model=model, prompt=[1] + list(range(40, 120)), max_tokens=4, temperature=0)
assert cached.usage.prompt_tokens_details.cached_tokens == 64, cached.usage

try:
    client.completions.create(model=model, prompt="x", max_tokens=1, temperature=-1)
    raise AssertionError("temperature -1 was accepted")
except openai.BadRequestError as e:
    assert "temperature" in str(e), e
try:
    openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    raise AssertionError("a wrong key was accepted")
except openai.AuthenticationError:
    pass
print("OK")
