"""The official `openai` Python client (pinned in scripts/test.sh) against `mlx-spec serve`.

Usage: python tests/serve_openai.py path/to/mlx-spec

Starts the server on a free loopback port with the default model, the ngram drafter and an
API key, then: models, completions and chat, each plain and streaming (the stream adds up to
the same text), per-request speculation through `extra_body`, seeds, errors as the client's
exception types, the key, and a clean exit on SIGTERM. Bounded: every call has a timeout.
"""

import os
import signal
import subprocess
import sys
import tempfile
import threading

import openai

KEY = "test-key-123"
PROMPT = "def read_config(path):"


def start(binary, config, key=KEY):
    """Starts `binary serve` with the ngram drafter on a free port: (process, address, log)."""
    env = dict(os.environ)
    if key:
        env["MLX_SPEC_OPENAI_TEST_KEY"] = key
    env.pop("MLX_SPEC_MODEL", None)
    proc = subprocess.Popen(
        [binary, "serve", "--config", config, "--port", "0", "--drafter", "ngram"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    found = {}
    ready = threading.Event()
    log = []

    def read():
        for line in proc.stderr:
            log.append(line)
            prefix = "mlx-spec: listening on http://"
            if line.startswith(prefix):
                found["addr"] = line[len(prefix):].strip()
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(60) or "addr" not in found:
        proc.kill()
        sys.exit("the server did not start:\n" + "".join(log))
    return proc, found["addr"], log


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def main():
    binary = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "deploy.toml")
        with open(config, "w") as f:
            # Drafting never pauses: whether each request drafts is under test, not the gate,
            # which may judge ngram not worth its rounds on a machine where they cost more; a
            # one-token match, so that the test's short outputs always find one.
            f.write('[server]\napi_key_env = "MLX_SPEC_OPENAI_TEST_KEY"\n')
            f.write('[drafter]\nname = "ngram"\nauto_off = false\n[drafter.config]\nmin_ngram = 1\n')
        proc, addr, log = start(binary, config)
        try:
            run(addr)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        check(code == 0, f"exit code {code} after SIGTERM:\n" + "".join(log))
    print("openai client tests passed")


def run(addr):
    client = openai.OpenAI(base_url=f"http://{addr}/v1", api_key=KEY, timeout=60, max_retries=0)
    models = client.models.list().data
    check(len(models) == 1 and models[0].id.startswith("gemma4-"), models)
    model = models[0].id

    # Completions, plain and streaming.
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=32)
    text = done.choices[0].text
    check(len(text) > 0, "empty completion")
    check(done.usage.completion_tokens == 32, done.usage)
    check(done.choices[0].finish_reason == "length", done.choices[0].finish_reason)
    spec = done.model_extra["speculation"]
    check(spec["drafter"] == "ngram" and spec["num_drafts"] > 0, spec)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=32, stream=True))
    check("".join(c.choices[0].text for c in chunks) == text, "streamed completion differs")
    check(chunks[-1].usage.completion_tokens == 32, chunks[-1])
    check(chunks[-1].choices[0].finish_reason == "length", chunks[-1])

    # Per-request speculation: the same greedy text with any drafter setting, or none.
    for speculation in ["off", {"drafter": "ngram", "num_draft_tokens": 3}]:
        other = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=32, extra_body={"speculation": speculation}
        )
        check(other.choices[0].text == text, f"{speculation}: text differs")
        drafts = other.model_extra["speculation"]["num_drafts"]
        check((drafts == 0) == (speculation == "off"), f"{speculation}: {drafts} drafts")

    # Chat, with a system message, plain and streaming.
    messages = [
        {"role": "system", "content": "Answer in Python."},
        {"role": "user", "content": "Read a JSON file."},
    ]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=24)
    reply = chat.choices[0].message
    check(reply.role == "assistant" and reply.content, reply)
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    check("".join(pieces) == reply.content, "streamed chat differs")

    # Seeds: the same seed, the same sample.
    sampled = [
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=24, temperature=0.9, seed=seed
        ).choices[0].text
        for seed in (5, 5, 6)
    ]
    check(sampled[0] == sampled[1], "same seed, other text")
    check(sampled[0] != sampled[2], "another seed, same text")

    # Errors arrive as the client's exception types, naming the field.
    for kwargs, param in [
        ({"max_tokens": -1}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"extra_body": {"speculation": {"drafter": "nope"}}}, "speculation.drafter"),
    ]:
        try:
            client.completions.create(model=model, prompt=PROMPT, **kwargs)
            raise AssertionError(f"{kwargs} was accepted")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and e.body["param"] == param, e.body)
    try:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError:
        pass
    wrong = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="wrong", timeout=30, max_retries=0)
    try:
        wrong.models.list()
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError as e:
        check(e.status_code == 401, e)


if __name__ == "__main__":
    main()
