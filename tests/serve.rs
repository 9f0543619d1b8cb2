//! `mlx-spec serve` on loopback: the real binary with the default model and real plugin
//! libraries, spoken to over plain HTTP/1.1 from this process. Each test starts its own server
//! on a free port and stops it at the end.
//!
//! Covered: completions and chat, JSON and server-sent events; the same tokens as the command
//! line; seeds; 16 concurrent clients with mixed drafters and settings, each answered exactly
//! as when alone; every bad request (an OpenAI-style error that never reaches the model); the
//! API key; a drafter that panics mid-request; a full queue (503 + Retry-After); disconnects
//! (streaming or not) freeing their slot with memory flat; speculation counters in /metrics
//! advancing mid-request; SIGTERM draining; bad deploy files.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{default_model, default_model_name, json_of, mlx_spec, repo_root};
use serde_json::{json, Value};

fn target_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_mlx-spec"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn lib_name(stem: &str) -> String {
    if cfg!(target_os = "macos") {
        format!("lib{stem}.dylib")
    } else {
        format!("lib{stem}.so")
    }
}

fn install(plugins: &Path, folder: &str, stem: &str, manifest: &str) {
    let library = target_dir().join(lib_name(stem));
    assert!(
        library.is_file(),
        "{} is not built (run `cargo build --release --workspace`)",
        library.display()
    );
    let dir = plugins.join(folder);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(&library, dir.join(library.file_name().unwrap())).unwrap();
    std::fs::write(dir.join("plugin.toml"), manifest).unwrap();
}

/// A folder holding a deploy file and a plugins directory: ngram, a drafter that panics
/// while drafting, and one that refuses to open.
fn deployment(server_toml: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let plugins = tmp.path().join("plugins");
    let ngram = std::fs::read_to_string(repo_root().join("plugins/ngram/plugin.toml")).unwrap();
    install(&plugins, "ngram", "mlx_spec_ngram", &ngram);
    for (name, mode) in [("panicky", "panic"), ("refuser", "refuse")] {
        // The library calls itself test-drafter; each mode gets its own plugins directory.
        let manifest = format!(
            "[plugin]\nname = \"test-drafter\"\nversion = \"0.1.0\"\nkind = \"other\"\napi = 1\nlibrary = \"{}\"\n[needs]\ntarget_families = [\"gemma4\"]\n[defaults]\nmode = \"{mode}\"\n",
            lib_name("mlx_spec_test_drafter")
        );
        install(
            &tmp.path().join(name),
            name,
            "mlx_spec_test_drafter",
            &manifest,
        );
    }
    let path = tmp.path().join("deploy.toml");
    let text = format!(
        "[model]\npath = \"{}\"\n[plugins]\ndirs = [\"plugins\"]\n{server_toml}",
        default_model().display()
    );
    std::fs::write(&path, text).unwrap();
    (tmp, path)
}

/// A running server, stopped (SIGKILL) when dropped unless it already exited.
struct Server {
    child: Child,
    addr: SocketAddr,
    stderr: Arc<Mutex<String>>,
}

impl Server {
    fn start(config: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_mlx-spec"));
        cmd.arg("serve")
            .arg("--config")
            .arg(config)
            .args(["--port", "0"])
            .args(args)
            .env_remove("MLX_SPEC_MODEL")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start mlx-spec serve");
        let stderr = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let pipe = child.stderr.take().unwrap();
        let log = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("mlx-spec: listening on http://") {
                    let _ = tx.send(addr.parse::<SocketAddr>().unwrap());
                }
                let mut l = log.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the server did not start: {}", stderr.lock().unwrap());
            }
        };
        assert!(addr.ip().is_loopback(), "binds loopback by default: {addr}");
        Server {
            child,
            addr,
            stderr,
        }
    }

    fn get(&self, path: &str) -> Response {
        request(self.addr, "GET", path, &[], b"")
    }

    fn post(&self, path: &str, body: &Value) -> Response {
        request(
            self.addr,
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        )
    }

    /// `speculation_detail` token ids and text of a completion, after checking its shape.
    fn complete(&self, body: &Value) -> (Vec<u32>, String, Value) {
        let mut body = body.clone();
        body["speculation_detail"] = json!(true);
        let r = self.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["object"], "text_completion");
        let ids = v["speculation_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["id"].as_u64().unwrap() as u32)
            .collect();
        (ids, v["choices"][0]["text"].as_str().unwrap().to_owned(), v)
    }

    fn metric(&self, line_start: &str) -> f64 {
        let text = self.get("/metrics").text();
        text.lines()
            .find_map(|l| l.strip_prefix(line_start))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no metric {line_start} in\n{text}"))
    }

    /// Waits until no request is running or waiting.
    fn wait_idle(&self) {
        let start = Instant::now();
        loop {
            let h = self.get("/health").json();
            if h["running"] == 0 && h["waiting"] == 0 {
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "never idle: {h}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Response {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of a server-sent event stream.
    fn events(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
            .map(str::to_owned)
            .collect()
    }

    /// The error object of an OpenAI-style error, checked for its shape.
    fn error(&self) -> Value {
        let v = self.json();
        let e = v["error"].clone();
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].as_str().is_some(), "{v}");
        e
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect to the server");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s
}

fn write_request(
    s: &mut TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    // A server may answer (and close) before reading all of a body it refuses.
    let _ = s.write_all(body);
}

/// One HTTP/1.1 request on a fresh connection; reads the whole response.
fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    let mut s = connect(addr);
    write_request(&mut s, method, path, headers, body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> Response {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head: {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    Response {
        status,
        headers,
        body,
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(end) = data.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(
            String::from_utf8_lossy(&data[..end])
                .split(';')
                .next()
                .unwrap()
                .trim(),
            16,
        )
        .unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = end + 2;
        out.extend_from_slice(&data[start..(start + size).min(data.len())]);
        data = &data[(start + size + 2).min(data.len())..];
    }
    out
}

/// Opens a streaming request and reads until its first content arrives; returns the open
/// connection (drop it to disconnect).
fn open_stream(addr: SocketAddr, body: &Value) -> TcpStream {
    let mut s = connect(addr);
    write_request(
        &mut s,
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    );
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"text\"") {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    s
}

const PROMPT: &str = "def read_config(path):";

/// A prompt whose continuation repeats it, so the ngram drafter's drafts are accepted.
const REPEATING: &str =
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):";

#[test]
fn completions_and_chat_answer_as_openai_does_and_match_the_command_line() {
    let (_dir, config) = deployment("[drafter]\nname = \"ngram\"\n");
    let server = Server::start(&config, &[], &[]);
    let health = server.get("/health");
    assert_eq!(
        (health.status, health.json()["status"].clone()),
        (200, json!("ok"))
    );
    let models = server.get("/v1/models").json();
    let name = default_model_name();
    assert_eq!(models["data"][0]["id"], name.as_str());
    assert_eq!(models["data"][0]["speculation"]["default"], "ngram");

    // The server's tokens are the command line's, with and without the drafter.
    let cli = json_of(&mlx_spec(&[
        "generate",
        "--prompt",
        REPEATING,
        "--max-tokens",
        "48",
        "--json",
    ]));
    let cli_tokens: Vec<u32> = cli["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let (ids, text, v) = server.complete(&json!({"prompt": REPEATING, "max_tokens": 48}));
    assert_eq!(ids, cli_tokens);
    assert_eq!(text, cli["text"].as_str().unwrap());
    let spec = &v["speculation"];
    assert_eq!(spec["drafter"], "ngram");
    assert!(spec["num_drafts"].as_u64().unwrap() > 0, "{v}");
    assert!(spec["num_accepted_tokens"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 48);
    assert_eq!(
        v["usage"]["total_tokens"],
        v["usage"]["prompt_tokens"].as_u64().unwrap() + 48
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // Accepted drafts show in the per-token detail.
    let kinds: Vec<&str> = v["speculation_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["kind"].as_str().unwrap())
        .collect();
    assert!(kinds.contains(&"accepted"), "{kinds:?}");
    let (off_ids, _, off) =
        server.complete(&json!({"prompt": REPEATING, "max_tokens": 48, "speculation": "off"}));
    assert_eq!(off_ids, cli_tokens);
    assert_eq!(off["speculation"]["num_drafts"], 0);

    // Streaming: the chunks add up to the same text; the last carries usage and
    // speculation; the stream ends in [DONE].
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": REPEATING, "max_tokens": 48, "stream": true}),
    );
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(chunks.len() > 2);
    let streamed: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, text);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 48);
    assert_eq!(last["speculation"]["drafter"], "ngram");

    // Chat: Gemma 4 turns with a system message, as the command line renders them.
    let cli_chat = json_of(&mlx_spec(&[
        "generate",
        "--chat",
        "Write a function",
        "--system",
        "Be brief",
        "--max-tokens",
        "20",
        "--json",
    ]));
    let messages = json!([{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Write a function"}]);
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 20}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], cli_chat["text"]);
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 20, "stream": true}),
    );
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, cli_chat["text"].as_str().unwrap());

    // A stop string ends the text before it; stop ids end generation.
    let (_, full, _) =
        server.complete(&json!({"prompt": REPEATING, "max_tokens": 48, "speculation": "off"}));
    let mid = full.char_indices().nth(full.chars().count() / 2).unwrap().0;
    let stop: String = full[mid..].chars().take(5).collect();
    let cut = full.find(&stop).unwrap();
    let (_, stopped, v) =
        server.complete(&json!({"prompt": REPEATING, "max_tokens": 48, "stop": [stop]}));
    assert_eq!(stopped, full[..cut]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let first = cli_tokens.iter().position(|&t| t == cli_tokens[5]).unwrap();
    let (_, _, v) =
        server.complete(&json!({"prompt": REPEATING, "max_tokens": 48, "stop": [cli_tokens[5]]}));
    assert_eq!(v["usage"]["completion_tokens"], first);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // The counters, by vLLM's names and by drafter.
    assert!(server.metric("mlx_spec:spec_decode_num_drafts_total{drafter=\"ngram\"}") > 0.0);
    assert!(
        server.metric("mlx_spec:spec_decode_num_accepted_tokens_total{drafter=\"ngram\"}") > 0.0
    );
    assert!(server.metric("mlx_spec:spec_decode_num_accepted_tokens_per_pos_total{drafter=\"ngram\",position=\"0\"}") > 0.0);
    assert!(server.metric("mlx_spec:time_to_first_token_seconds_count") >= 6.0);
    server.wait_idle();
}

#[test]
fn seeded_sampling_is_reproducible_and_matches_the_command_line() {
    let (_dir, config) = deployment("");
    let server = Server::start(&config, &[], &[]);
    let body = |seed: u64| json!({"prompt": PROMPT, "max_tokens": 40, "temperature": 0.9, "top_p": 0.95, "seed": seed, "ignore_eos": true});
    let (a, _, _) = server.complete(&body(7));
    let (b, _, _) = server.complete(&body(7));
    let (c, _, _) = server.complete(&body(8));
    assert_eq!(a, b);
    assert_ne!(a, c, "another seed draws other tokens");
    let cli = json_of(&mlx_spec(&[
        "generate",
        "--prompt",
        PROMPT,
        "--max-tokens",
        "40",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--seed",
        "7",
        "--ignore-eos",
        "--json",
    ]));
    let cli: Vec<u32> = cli["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(a, cli);
}

#[test]
fn sixteen_concurrent_clients_each_get_what_they_get_alone() {
    let (_dir, config) = deployment(
        "[drafter]\nname = \"ngram\"\n[drafters.short]\nplugin = \"ngram\"\nnum_draft_tokens = 2\n[drafters.short.config]\nmax_ngram = 2\n[server]\nmax_active = 8\nqueue_length = 16\n",
    );
    let server = Server::start(&config, &[], &[]);
    let prompts = [
        PROMPT,
        "import os\n\ndef main():",
        "class Stack:\n    def __init__(self):",
        "for i in range(10):",
    ];
    let bodies: Vec<Value> = (0..16)
        .map(|i| {
            let speculation = match i % 4 {
                0 => json!("off"),
                1 => json!({"drafter": "ngram"}),
                2 => json!({"drafter": "short"}),
                _ => json!({"drafter": "ngram", "num_draft_tokens": 5}),
            };
            let mut b = json!({
                "prompt": prompts[i % prompts.len()],
                "max_tokens": 16 + 4 * (i % 5),
                "speculation": speculation,
                "ignore_eos": i % 2 == 0,
                "stream": i % 3 == 0,
            });
            if i % 4 >= 2 {
                b["temperature"] = json!(0.8);
                b["seed"] = json!(i);
            }
            b
        })
        .collect();
    let tokens_of = |server: &Server, body: &Value| -> Vec<u32> {
        let mut b = body.clone();
        b["speculation_detail"] = json!(true);
        let r = server.post("/v1/completions", &b);
        assert_eq!(r.status, 200, "{}", r.text());
        let detail: Vec<Value> = if b["stream"] == true {
            let events = r.events();
            assert_eq!(events.last().unwrap(), "[DONE]");
            events[..events.len() - 1]
                .iter()
                .flat_map(|e| {
                    let c: Value = serde_json::from_str(e).unwrap();
                    c["speculation_tokens"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default()
                })
                .collect()
        } else {
            r.json()["speculation_tokens"].as_array().unwrap().clone()
        };
        detail
            .iter()
            .map(|t| t["id"].as_u64().unwrap() as u32)
            .collect()
    };
    let alone: Vec<Vec<u32>> = bodies.iter().map(|b| tokens_of(&server, b)).collect();
    let server = Arc::new(server);
    let together: Vec<Vec<u32>> = std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| {
                let server = server.clone();
                s.spawn(move || tokens_of(&server, b))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert!(!a.is_empty());
        assert_eq!(
            a, t,
            "request {i} ({}) differs when run with the others",
            bodies[i]
        );
    }
    server.wait_idle();
}

#[test]
fn bad_requests_get_openai_errors_and_never_reach_the_model() {
    let (_dir, config) = deployment(
        "[drafter]\nname = \"ngram\"\n[server]\nmax_prompt_tokens = 32\nmax_new_tokens = 100\nmax_body_bytes = 4096\n",
    );
    let server = Server::start(&config, &[], &[]);
    let long_prompt = "x = 1\n".repeat(40);
    let cases: Vec<(Value, u16, Option<&str>)> = vec![
        (
            json!({"prompt": PROMPT, "max_tokens": -5}),
            400,
            Some("max_tokens"),
        ),
        (
            json!({"prompt": PROMPT, "max_tokens": 101}),
            400,
            Some("max_tokens"),
        ),
        (
            json!({"prompt": PROMPT, "max_tokens": 1e30}),
            400,
            Some("max_tokens"),
        ),
        (
            json!({"prompt": PROMPT, "max_tokens": "ten"}),
            400,
            Some("max_tokens"),
        ),
        (
            json!({"prompt": PROMPT, "temperature": "hot"}),
            400,
            Some("temperature"),
        ),
        (json!({"prompt": PROMPT, "top_p": 1.5}), 400, Some("top_p")),
        (json!({"prompt": PROMPT, "n": 2}), 400, Some("n")),
        (json!({"prompt": PROMPT, "seed": -1}), 400, Some("seed")),
        (json!({"prompt": [1, 2, 999_999]}), 400, Some("prompt")),
        (json!({"prompt": []}), 400, Some("prompt")),
        (json!({"prompt": long_prompt}), 400, Some("prompt")),
        (
            json!({"prompt": PROMPT, "model": "gpt-4"}),
            404,
            Some("model"),
        ),
        (
            json!({"prompt": PROMPT, "speculation": {"drafter": "eagle"}}),
            400,
            Some("speculation.drafter"),
        ),
        (
            json!({"prompt": PROMPT, "speculation": {"num_draft_tokens": 65}}),
            400,
            Some("speculation.num_draft_tokens"),
        ),
        (
            json!({"prompt": PROMPT, "speculation": {"num_draft_tokens": "4"}}),
            400,
            Some("speculation.num_draft_tokens"),
        ),
        (
            json!({"prompt": PROMPT, "speculation": 3}),
            400,
            Some("speculation"),
        ),
        (json!({"prompt": PROMPT, "stop": [""]}), 400, Some("stop")),
        (
            json!({"prompt": PROMPT, "stop": [999_999]}),
            400,
            Some("stop"),
        ),
        (json!({"messages": []}), 400, Some("messages")),
        (json!([1, 2]), 400, None),
    ];
    for (body, status, param) in &cases {
        let r = server.post("/v1/completions", body);
        assert_eq!(r.status, *status, "{body}: {}", r.text());
        let e = r.error();
        assert_eq!(e["param"].as_str(), *param, "{body}: {e}");
    }
    let chat_cases: Vec<(Value, &str)> = vec![
        (json!({"messages": "hi"}), "messages"),
        (
            json!({"messages": [{"role": "robot", "content": "hi"}]}),
            "messages[0].role",
        ),
        (
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
        ),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}),
            "max_completion_tokens",
        ),
    ];
    for (body, param) in &chat_cases {
        let r = server.post("/v1/chat/completions", body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(r.error()["param"], *param, "{body}");
    }
    // Bodies that are not JSON, too large, and routes and methods that do not exist.
    let raw = |method: &str, path: &str, body: &[u8]| request(server.addr, method, path, &[], body);
    for body in [&b"{\"prompt\": "[..], b"\xff\xfe", b"", b"null"] {
        let r = raw("POST", "/v1/completions", body);
        assert_eq!(
            r.status,
            400,
            "{:?}: {}",
            String::from_utf8_lossy(body),
            r.text()
        );
        r.error();
    }
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(8000));
    let r = raw("POST", "/v1/completions", big.as_bytes());
    assert_eq!(r.status, 413, "{}", r.text());
    assert!(r.error()["message"].as_str().unwrap().contains("4096"));
    let r = raw("GET", "/v1/engines", b"");
    assert_eq!(r.status, 404);
    r.error();
    let r = raw("GET", "/v1/completions", b"");
    assert_eq!(r.status, 405);
    r.error();
    let r = raw("DELETE", "/v1/models", b"");
    assert_eq!(r.status, 405);

    // Not one of them reached the model, and the server still answers.
    assert_eq!(server.metric("mlx_spec:prompt_tokens_total"), 0.0);
    assert_eq!(
        server.metric("mlx_spec:time_to_first_token_seconds_count"),
        0.0
    );
    let (ids, _, _) = server.complete(&json!({"prompt": PROMPT, "max_tokens": 5}));
    assert_eq!(ids.len(), 5);
    assert!(
        server.metric("mlx_spec:http_requests_total{route=\"/v1/completions\",status=\"400\"}")
            >= 20.0
    );
}

#[test]
fn the_api_key_is_required_on_the_api_when_set() {
    let (_dir, config) = deployment("[server]\napi_key_env = \"MLX_SPEC_TEST_KEY\"\n");
    // The variable named but not set: the start fails naming the file's line and key.
    let out = Command::new(env!("CARGO_BIN_EXE_mlx-spec"))
        .args(["serve", "--port", "0", "--config"])
        .arg(&config)
        .env_remove("MLX_SPEC_TEST_KEY")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("line 6 (api_key_env)") && err.contains("MLX_SPEC_TEST_KEY"),
        "{err}"
    );

    let server = Server::start(&config, &[], &[("MLX_SPEC_TEST_KEY", "s3cret")]);
    let body = json!({"prompt": PROMPT, "max_tokens": 4}).to_string();
    let with = |auth: Option<&str>, path: &str, body: &[u8]| {
        let mut headers = vec![("Content-Type", "application/json")];
        if let Some(a) = auth {
            headers.push(("Authorization", a));
        }
        request(
            server.addr,
            if body.is_empty() { "GET" } else { "POST" },
            path,
            &headers,
            body,
        )
    };
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("s3cret"),
        Some("Bearer s3cre"),
    ] {
        let r = with(auth, "/v1/completions", body.as_bytes());
        assert_eq!(r.status, 401, "{auth:?}");
        assert_eq!(r.error()["code"], "invalid_api_key");
        assert_eq!(with(auth, "/v1/models", b"").status, 401);
    }
    let r = with(Some("Bearer s3cret"), "/v1/completions", body.as_bytes());
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(with(Some("Bearer s3cret"), "/v1/models", b"").status, 200);
    // Health and metrics stay open to probes.
    assert_eq!(with(None, "/health", b"").status, 200);
    assert_eq!(with(None, "/metrics", b"").status, 200);
}

#[test]
fn a_drafter_that_panics_mid_request_is_switched_off_and_the_answer_stays_right() {
    let (dir, config) = deployment("[drafters.panicky]\nplugin = \"test-drafter\"\n");
    let panicky = dir.path().join("panicky");
    let server = Server::start(&config, &["--plugins-dir", panicky.to_str().unwrap()], &[]);
    let body = json!({"prompt": PROMPT, "max_tokens": 30});
    let (plain, _, _) =
        server.complete(&json!({"prompt": PROMPT, "max_tokens": 30, "speculation": "off"}));
    let mut with = body.clone();
    with["speculation"] = json!({"drafter": "panicky"});
    let (ids, _, v) = server.complete(&with);
    assert_eq!(ids, plain);
    let error = v["speculation"]["drafter_error"]
        .as_str()
        .unwrap_or_default();
    assert!(error.contains("panic"), "{v}");
    // Streaming too, and the server stays up for the next request.
    with["stream"] = json!(true);
    let r = server.post("/v1/completions", &with);
    assert_eq!(r.events().last().unwrap(), "[DONE]");
    assert_eq!(server.get("/health").status, 200);
    let (again, _, _) = server.complete(&with_stream_off(&with));
    assert_eq!(again, plain);
    assert_eq!(
        server.metric("mlx_spec:spec_decode_drafter_errors_total{drafter=\"panicky\"}"),
        3.0
    );
}

fn with_stream_off(body: &Value) -> Value {
    let mut b = body.clone();
    b["stream"] = json!(false);
    b
}

#[test]
fn a_full_queue_answers_503_and_a_client_that_leaves_frees_its_slot() {
    let (_dir, config) = deployment("[server]\nmax_active = 1\nqueue_length = 1\n");
    let server = Server::start(&config, &[], &[]);
    let long = json!({"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": true, "stream": true, "speculation": "off"});
    let first = open_stream(server.addr, &long);
    let second = open_stream_queued(server.addr, &long);
    // One generating, one waiting: the third is refused at once.
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 4}),
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.error()["code"], "queue_full");
    assert_eq!(server.metric("mlx_spec:num_requests_running"), 1.0);
    assert_eq!(server.metric("mlx_spec:num_requests_waiting"), 1.0);
    // Both clients leave: their generations stop and their places free up.
    drop(first);
    drop(second);
    server.wait_idle();
    let (ids, _, _) = server.complete(&json!({"prompt": PROMPT, "max_tokens": 4}));
    assert_eq!(ids.len(), 4);
    assert!(server.metric("mlx_spec:request_success_total{finished_reason=\"abort\"}") >= 2.0);
    // Nowhere near 4000 tokens were generated for the clients that left.
    assert!(server.metric("mlx_spec:generation_tokens_total") < 100.0);
}

#[test]
fn a_non_streaming_client_that_leaves_frees_its_slot() {
    let (_dir, config) = deployment("[server]\nmax_active = 1\nqueue_length = 0\n");
    let server = Server::start(&config, &[], &[]);
    // Far more tokens than the test waits for: only a stopped generation frees the slot.
    let long =
        json!({"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": true, "speculation": "off"});
    let mut s = connect(server.addr);
    write_request(
        &mut s,
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        long.to_string().as_bytes(),
    );
    let start = Instant::now();
    while server.get("/health").json()["running"] != 1 {
        assert!(start.elapsed() < Duration::from_secs(30), "never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The only slot is taken: another request is refused.
    let short = json!({"prompt": PROMPT, "max_tokens": 4});
    assert_eq!(server.post("/v1/completions", &short).status, 503);
    std::thread::sleep(Duration::from_millis(300));
    // The client leaves before any byte of the answer (none comes before the end).
    drop(s);
    let left = Instant::now();
    server.wait_idle();
    assert!(
        left.elapsed() < Duration::from_secs(5),
        "the slot freed only after {:?}",
        left.elapsed()
    );
    let (ids, _, _) = server.complete(&short);
    assert_eq!(ids.len(), 4);
    assert_eq!(
        server.metric("mlx_spec:request_success_total{finished_reason=\"abort\"}"),
        1.0
    );
    // Only the short request ran to its length; the one that left was ended.
    assert_eq!(
        server.metric("mlx_spec:request_success_total{finished_reason=\"length\"}"),
        1.0
    );
    assert!(server.metric("mlx_spec:generation_tokens_total") < 100.0);
}

#[test]
fn speculation_counters_advance_while_a_request_runs() {
    let (_dir, config) = deployment("[drafter]\nname = \"ngram\"\n");
    let server = Server::start(&config, &[], &[]);
    let drafted = "mlx_spec:spec_decode_num_draft_tokens_total{drafter=\"ngram\"}";
    let accepted = "mlx_spec:spec_decode_num_accepted_tokens_total{drafter=\"ngram\"}";
    assert_eq!(server.metric(drafted), 0.0);
    let body = json!({"prompt": REPEATING, "max_tokens": 1500, "ignore_eos": true, "stream": true});
    let mut stream = open_stream(server.addr, &body);
    // Scraped mid-request: the drafts of the rounds so far already count.
    let start = Instant::now();
    loop {
        let n = server.metric(drafted);
        let running = server.get("/health").json()["running"] == 1;
        assert!(running, "the request ended before its drafts were counted");
        if n > 0.0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no drafts counted"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // At its end, the rounds' counts add up to the request's own.
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).unwrap();
    let text = String::from_utf8_lossy(&rest);
    let last: Value = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|v| v.get("speculation").is_some())
        .unwrap_or_else(|| panic!("no speculation in {text}"));
    let s = &last["speculation"];
    assert!(s["num_accepted_tokens"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(
        server.metric(drafted),
        s["num_draft_tokens"].as_u64().unwrap() as f64
    );
    assert_eq!(
        server.metric(accepted),
        s["num_accepted_tokens"].as_u64().unwrap() as f64
    );
    assert_eq!(
        server.metric("mlx_spec:spec_decode_num_drafts_total{drafter=\"ngram\"}"),
        s["num_drafts"].as_u64().unwrap() as f64
    );
    let first_position = s["accepted_per_position"][0].as_u64().unwrap();
    assert_eq!(
        server.metric("mlx_spec:spec_decode_num_accepted_tokens_per_pos_total{drafter=\"ngram\",position=\"0\"}"),
        first_position as f64
    );
}

/// A streaming request sent without waiting for content (it waits in the queue).
fn open_stream_queued(addr: SocketAddr, body: &Value) -> TcpStream {
    let mut s = connect(addr);
    write_request(
        &mut s,
        "POST",
        "/v1/completions",
        &[],
        body.to_string().as_bytes(),
    );
    let start = Instant::now();
    // Wait until the server has it queued.
    loop {
        let v = request(addr, "GET", "/health", &[], b"").json();
        if v["waiting"] == 1 {
            return s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "never queued: {v}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn two_hundred_requests_with_random_disconnects_leave_memory_flat() {
    let (_dir, config) = deployment("[drafter]\nname = \"ngram\"\n[server]\nmax_active = 4\n");
    let server = Server::start(&config, &[], &[]);
    let body = |i: u64| json!({"prompt": PROMPT, "max_tokens": 6 + i % 10, "ignore_eos": true, "stream": true, "temperature": 0.7, "seed": i});
    // A small deterministic generator picks which clients leave, and when.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut plan: Vec<(u64, bool)> = (0..200).map(|i| (i, next() % 3 == 0)).collect();
    let mut rss = Vec::new();
    for round in plan.chunks_mut(20) {
        std::thread::scope(|s| {
            for &mut (i, leave) in round.iter_mut() {
                let addr = server.addr;
                let b = body(i);
                s.spawn(move || {
                    if leave {
                        drop(open_stream(addr, &b));
                    } else {
                        let r = request(
                            addr,
                            "POST",
                            "/v1/completions",
                            &[],
                            b.to_string().as_bytes(),
                        );
                        assert_eq!(r.status, 200);
                        assert_eq!(r.events().last().unwrap(), "[DONE]");
                    }
                });
            }
        });
        server.wait_idle();
        rss.push(server.rss_kib());
    }
    let aborted = server.metric("mlx_spec:request_success_total{finished_reason=\"abort\"}");
    assert!(aborted > 20.0, "{aborted}");
    // After the first rounds (allocator caches, the tokenizer's warm-up), memory stays flat.
    let warm = rss[2];
    let last = *rss.last().unwrap();
    assert!(
        last < warm + 48 * 1024,
        "resident memory grew from {warm} KiB to {last} KiB over 200 requests: {rss:?}"
    );
}

#[test]
fn sigterm_finishes_the_requests_in_flight_then_exits() {
    let (_dir, config) = deployment("");
    let mut server = Server::start(&config, &[], &[]);
    let body = json!({"prompt": PROMPT, "max_tokens": 300, "ignore_eos": true, "stream": true, "speculation": "off"});
    let mut stream = open_stream(server.addr, &body);
    let status = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    // The request in flight finishes in full.
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).unwrap();
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("[DONE]"), "{text}");
    assert!(text.contains("\"completion_tokens\":300"), "{text}");
    // Then the process exits cleanly, and nothing listens any more.
    let start = Instant::now();
    let exit = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the server did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        exit.success(),
        "{exit:?}: {}",
        server.stderr.lock().unwrap()
    );
    assert!(TcpStream::connect(server.addr).is_err());
    assert!(server.stderr.lock().unwrap().contains("draining"));
}

#[test]
fn a_bad_deploy_file_or_plugin_stops_the_start_naming_where() {
    let start = |server_toml: &str, args: &[&str]| -> String {
        let (dir, config) = deployment(server_toml);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_mlx-spec"));
        cmd.args(["serve", "--port", "0", "--config"])
            .arg(&config)
            .args(args);
        let out = cmd.output().unwrap();
        assert!(!out.status.success(), "{server_toml:?} started");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!err.contains("panicked"), "{err}");
        drop(dir);
        err
    };
    // [model] and [plugins] take lines 1-4.
    let err = start("[server]\nmax_active = 0\n", &[]);
    assert!(err.contains("line 6 (max_active)"), "{err}");
    let err = start("[server]\nhost = \"localhost\"\n", &[]);
    assert!(err.contains("line 6 (host)"), "{err}");
    let err = start("[server]\nbind = \"0.0.0.0\"\n", &[]);
    assert!(err.contains("bind") && err.contains("line 6"), "{err}");
    // A drafter whose plugin is not there, or that refuses the model.
    let err = start("[drafters.fast]\nplugin = \"eagle\"\n", &[]);
    assert!(
        err.contains("line 5 ([drafters.fast])") && err.contains("eagle"),
        "{err}"
    );
    let (dir, _) = deployment("");
    let refuser = dir.path().join("refuser");
    let err = start(
        "[drafters.r]\nplugin = \"test-drafter\"\n",
        &["--plugins-dir", refuser.to_str().unwrap()],
    );
    assert!(err.contains("refuses"), "{err}");
}

#[test]
fn a_request_past_its_timeout_is_ended_with_an_error() {
    // Long enough that a 4-token request finishes on a loaded 2-core machine, far shorter
    // than 4 000 tokens take anywhere.
    let (_dir, config) = deployment("[server]\nrequest_timeout_s = 2.0\n");
    let server = Server::start(&config, &[], &[]);
    let body =
        json!({"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": true, "speculation": "off"});
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.status, 504, "{}", r.text());
    assert_eq!(r.error()["code"], "timeout");
    // Streaming: an error event, then the end of the stream.
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let events = server.post("/v1/completions", &streaming).events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(error["error"]["code"], "timeout", "{events:?}");
    assert!(server.metric("mlx_spec:request_success_total{finished_reason=\"timeout\"}") >= 2.0);
    // Short requests still finish.
    let (ids, _, _) = server.complete(&json!({"prompt": PROMPT, "max_tokens": 4}));
    assert_eq!(ids.len(), 4);
}
