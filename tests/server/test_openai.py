"""The official `openai` Python client against `specdec serve`, on tiny models and on the default pair:
chat, completions, streaming, usage, stop strings, logprobs, extensions and errors."""

import openai
import pytest


def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=600)


def model_id(c):
    models = c.models.list().data
    assert len(models) == 1
    return models[0].id


CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Write a Python function that adds two numbers."}]


def test_chat_completion(server):
    c = client(server)
    r = c.chat.completions.create(model=model_id(c), messages=CHAT, max_tokens=24, temperature=0)
    choice = r.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    spec = r.model_extra["speculative"]
    assert spec["drafter"] == "hybrid"
    assert spec["accepted"] <= spec["drafted"]


def test_completion(server):
    c = client(server)
    r = c.completions.create(model=model_id(c), prompt="def fibonacci(n):", max_tokens=12, temperature=0)
    assert isinstance(r.choices[0].text, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12


def test_streaming_equals_non_streaming(server):
    c = client(server)
    m = model_id(c)
    whole = c.chat.completions.create(model=m, messages=CHAT, max_tokens=32, temperature=0)
    stream = c.chat.completions.create(model=m, messages=CHAT, max_tokens=32, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings(server):
    c = client(server)
    m = model_id(c)
    whole = c.completions.create(model=m, prompt="def fibonacci(n):", max_tokens=40, temperature=0)
    text = whole.choices[0].text
    if len(text) < 8:
        pytest.skip(f"the model ended after {len(text)} characters; no room for a stop string")
    stop = text[5:8]
    want = text[: text.index(stop)]
    r = c.completions.create(model=m, prompt="def fibonacci(n):", max_tokens=40, temperature=0, stop=[stop])
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=m, prompt="def fibonacci(n):", max_tokens=40, temperature=0, stop=stop, stream=True)
        if ch.choices)
    assert streamed == want


def test_logprobs(server):
    c = client(server)
    r = c.chat.completions.create(model=model_id(c), messages=CHAT, max_tokens=8, temperature=0,
                                  logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        # Greedy: the chosen token is the most likely.
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)


def test_logprob_bytes_are_each_tokens_own_bytes(server):
    """A token that holds part of a character (emoji and CJK text split into byte tokens) reports its
    own bytes, so the tokens' bytes together spell the reply, and its `token` is `bytes:` with escapes
    rather than a replacement character."""
    c = client(server)
    msgs = [{"role": "user", "content": "Reply with three animal emoji and the Chinese word for cat, nothing else."}]
    r = c.chat.completions.create(model=model_id(c), messages=msgs, max_tokens=24, temperature=0,
                                  logprobs=True, top_logprobs=2)
    text = r.choices[0].message.content
    content = r.choices[0].logprobs.content
    for t in [*content, *(alt for t in content for alt in t.top_logprobs)]:
        b = bytes(t.bytes)
        try:
            assert t.token == b.decode("utf-8")
        except UnicodeDecodeError:
            assert t.token.startswith("bytes:"), t
    raw = b"".join(bytes(t.bytes) for t in content)
    # A random tiny model leaves characters unfinished: its reply holds U+FFFD for each maximal
    # invalid byte sequence (Unicode's recommended substitution, which Python's decoder follows
    # too), so the reply is the lossy decoding of the tokens' bytes; where they are valid UTF-8,
    # their plain decoding.
    assert raw.decode("utf-8", errors="replace") == text


def test_drafters_give_the_same_greedy_text(server):
    c = client(server)
    m = model_id(c)
    texts = set()
    for drafter, draft_len in [("none", 4), ("ngram", 4), ("model", 3), ("hybrid", "auto")]:
        r = c.chat.completions.create(model=m, messages=CHAT, max_tokens=40, temperature=0,
                                      extra_body={"drafter": drafter, "draft_len": draft_len})
        assert r.model_extra["speculative"]["drafter"] == drafter
        texts.add(r.choices[0].message.content)
    assert len(texts) == 1, texts


def test_seeded_sampling_in_onehot_mode_is_plain_sampling(server):
    # One-hot verification gives exactly plain sampling's tokens for a seed, whatever was drafted (in
    # rejection mode a seed fixes the output only for a fixed draft sequence; `auto` draft lengths
    # follow measured timings).
    c = client(server)
    m = model_id(c)
    texts = set()
    for drafter in ["none", "hybrid", "model"]:
        r = c.chat.completions.create(model=m, messages=CHAT, max_tokens=24, temperature=0.8, top_p=0.95,
                                      seed=7, extra_body={"drafter": drafter, "verify_mode": "onehot"})
        texts.add(r.choices[0].message.content)
    assert len(texts) == 1, texts


def test_bad_requests_raise_openai_errors(server):
    c = client(server)
    m = model_id(c)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=m, messages=CHAT, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=m, messages=[])
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=m, messages=CHAT, max_tokens=10**7)
    assert e.value.body["code"] == "context_length_exceeded"
    # Still serving.
    assert c.chat.completions.create(model=m, messages=CHAT, max_tokens=2).choices
