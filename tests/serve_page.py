"""The page at `GET /` of `mlx-spec serve`, in headless Chromium (installed by scripts/test.sh).

Usage: python tests/serve_page.py path/to/mlx-spec path/to/chromium OUT_DIR

Starts the server with the ngram drafter and opens the page twice. Completion mode: with
`?autorun=1` it sends one streaming request. Chat mode: the test uses the page as a person
would (chat chosen, a system message and a message typed, Send clicked). Each time it waits
for the request through Chromium's DevTools protocol (a minimal WebSocket client below: the
standard library has none) and checks the page Chromium rendered: tokens coloured by how they
were made (accepted drafts among them), the request's speculation stats filled in and
agreeing with the tokens shown. Writes OUT_DIR/serve-page.png and OUT_DIR/serve-page-chat.png
(screenshots) and the pages' HTML beside them.
"""

import base64
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

from serve_openai import start

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):"
SYSTEM = "You write Python."

# Chat mode as a person uses it: once the page has loaded the model, choose chat, type a
# system message and a message, press Send.
CHAT_ACTION = f"""(() => {{
  if (!document.getElementById('drafter').options.length) return false;
  document.querySelector('input[name=mode][value=chat]').click();
  document.getElementById('system').value = {json.dumps(SYSTEM)};
  document.getElementById('prompt').value = {json.dumps(PROMPT)};
  document.getElementById('max_tokens').value = '96';
  document.getElementById('send').click();
  return true;
}})()"""


class WebSocket:
    """The least of a WebSocket client (RFC 6455) the DevTools protocol needs: text frames."""

    def __init__(self, url):
        hostport, path = url[len("ws://"):].split("/", 1)
        host, port = hostport.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.exact(1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise AssertionError(f"no WebSocket upgrade: {head!r}")
        self.next_id = 0

    def exact(self, n):
        out = b""
        while len(out) < n:
            part = self.sock.recv(n - len(out))
            if not part:
                raise AssertionError("the browser closed the connection")
            out += part
        return out

    def send(self, text):
        data = text.encode()
        mask = os.urandom(4)
        n = len(data)
        if n < 126:
            head = bytes([0x81, 0x80 | n])
        elif n < 65536:
            head = bytes([0x81, 0x80 | 126]) + struct.pack(">H", n)
        else:
            head = bytes([0x81, 0x80 | 127]) + struct.pack(">Q", n)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def receive(self):
        message = b""
        while True:
            b1, b2 = self.exact(2)
            n = b2 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self.exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self.exact(8))[0]
            payload = self.exact(n)
            if b1 & 0x0F in (0, 1, 2):
                message += payload
                if b1 & 0x80:
                    return message.decode()

    def call(self, method, **params):
        """One DevTools command; returns its result (events in between are skipped)."""
        self.next_id += 1
        self.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.receive())
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply["result"]


def browse(binary, profile, url, action=None, deadline_s=90):
    """Opens `url` in headless Chromium, runs `action` (JavaScript that returns false until
    the page is ready for it) if given, and waits (in real time) for the page's request to
    finish; returns the page's HTML and a PNG screenshot."""
    args = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--remote-debugging-port=0",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
        url,
    ]
    browser = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        port = None
        for line in browser.stderr:
            found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if found:
                port = found.group(1)
                break
        if port is None:
            raise AssertionError("Chromium did not start its DevTools endpoint")
        listing = urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30)
        page = next(t for t in json.load(listing) if t["type"] == "page")
        ws = WebSocket(page["webSocketDebuggerUrl"])
        begun = time.monotonic()
        while action is not None:
            done = ws.call("Runtime.evaluate", expression=action, returnByValue=True)
            if done["result"].get("value") is True:
                break
            if time.monotonic() - begun > deadline_s:
                raise AssertionError("the page never loaded its model")
            time.sleep(0.1)
        while True:
            state = ws.call(
                "Runtime.evaluate",
                expression="document.getElementById('stats').dataset.done === '1'"
                " || document.getElementById('error').textContent",
                returnByValue=True,
            )["result"].get("value")
            if state is True:
                break
            if isinstance(state, str) and state:
                raise AssertionError(f"the page shows an error: {state}")
            if time.monotonic() - begun > deadline_s:
                raise AssertionError("the page's request did not finish in time")
            time.sleep(0.2)
        html = ws.call(
            "Runtime.evaluate", expression="document.documentElement.outerHTML", returnByValue=True
        )["result"]["value"]
        png = base64.b64decode(ws.call("Page.captureScreenshot", format="png")["data"])
        return html, png
    finally:
        browser.kill()
        browser.wait()


def main():
    binary, browser, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "deploy.toml")
        with open(config, "w") as f:
            # Drafting never pauses: the page's colouring is under test, not the gate, which
            # may judge ngram not worth its rounds on a machine where they cost more.
            f.write('[drafter]\nname = "ngram"\nauto_off = false\n[drafter.config]\nmin_ngram = 1\n')
        proc, addr, _log = start(binary, config, key=None)
        try:
            query = urllib.parse.urlencode(
                {"autorun": "1", "mode": "completion", "prompt": PROMPT, "max_tokens": "96"}
            )
            dom, png = browse(browser, os.path.join(tmp, "profile"), f"http://{addr}/?{query}")
            shot = keep(out_dir, "serve-page", dom, png)
            check_dom(dom)
            if served(addr, "/v1/completions") != 1:
                raise AssertionError("the completion page did not call /v1/completions")
            dom, png = browse(
                browser, os.path.join(tmp, "profile-chat"), f"http://{addr}/", CHAT_ACTION
            )
            chat_shot = keep(out_dir, "serve-page-chat", dom, png)
            check_dom(dom)
            # The page sent a chat request, not a completion.
            if served(addr, "/v1/chat/completions") != 1 or served(addr, "/v1/completions") != 1:
                raise AssertionError("the chat page did not call /v1/chat/completions once")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    print(f"page test passed; screenshots in {shot} and {chat_shot}")


def keep(out_dir, name, dom, png):
    """Writes a page's HTML and screenshot to out_dir; returns the screenshot's path."""
    with open(os.path.join(out_dir, name + ".html"), "w") as f:
        f.write(dom)
    shot = os.path.join(out_dir, name + ".png")
    with open(shot, "wb") as f:
        f.write(png)
    if len(png) < 10_000:
        raise AssertionError(f"the screenshot {shot} is nearly empty")
    return shot


def served(addr, route):
    """Requests to `route` answered 200, from the server's /metrics."""
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=30).read().decode()
    line = f'mlx_spec:http_requests_total{{route="{route}",status="200"}} '
    return sum(int(l[len(line):]) for l in text.splitlines() if l.startswith(line))


def check_dom(dom):
    if 'data-done="1"' not in dom:
        raise AssertionError("the request's stats never showed:\n" + dom[-3000:])
    kinds = re.findall(r'<span class="(accepted|bonus|correction)" title="', dom)
    plain = re.findall(r'<span title="target \(id', dom)
    accepted = kinds.count("accepted")
    if accepted == 0:
        raise AssertionError(f"no accepted drafts coloured: {kinds}")
    # The stats the page shows agree with the tokens it coloured.
    shown = dict(re.findall(r"<tr><td>([^<]+)</td><td>([^<]*)</td></tr>", dom))
    if int(shown["drafts accepted"]) != accepted:
        raise AssertionError(f"{accepted} accepted tokens coloured, stats say {shown}")
    total = len(kinds) + len(plain)
    if int(shown["generated tokens"]) != total:
        raise AssertionError(f"{total} tokens shown, stats say {shown}")
    if shown["drafter"] != "ngram":
        raise AssertionError(shown)


if __name__ == "__main__":
    main()
