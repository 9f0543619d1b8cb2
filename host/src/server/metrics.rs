//! The server's counters, rendered in Prometheus' text format at `GET /metrics`.
//!
//! Names follow vLLM's where vLLM has one (`vllm:` becomes `mlx_spec:`): the speculative
//! decoding counters `spec_decode_num_drafts`, `spec_decode_num_draft_tokens`,
//! `spec_decode_num_accepted_tokens` and `spec_decode_num_accepted_tokens_per_pos` (by
//! drafter), `num_requests_running`, `num_requests_waiting`, `request_success`,
//! `prompt_tokens`, `generation_tokens`, `time_to_first_token_seconds` and
//! `e2e_request_latency_seconds`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use crate::speculative::SpecStats;

/// A cumulative histogram over fixed bucket bounds.
#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// A label value as Prometheus' text format writes it.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

const SECONDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
const TOKENS_PER_S: &[f64] = &[
    1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0,
];

/// A per-drafter counter: its name, help text and value.
type Counter = (&'static str, &'static str, fn(&SpecTotals) -> u64);

#[derive(Debug, Clone, Default)]
struct SpecTotals {
    num_drafts: u64,
    num_draft_tokens: u64,
    num_accepted_tokens: u64,
    accepted_per_pos: Vec<u64>,
    drafter_errors: u64,
}

#[derive(Debug)]
struct Inner {
    http: BTreeMap<(String, u16), u64>,
    finished: BTreeMap<String, u64>,
    prompt_tokens: u64,
    generation_tokens: u64,
    running: usize,
    waiting: usize,
    ttft: Histogram,
    e2e: Histogram,
    tokens_per_s: Histogram,
    spec: BTreeMap<String, SpecTotals>,
}

/// Every counter of the server, shared by the HTTP side and the engine.
#[derive(Debug)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics {
            inner: Mutex::new(Inner {
                http: BTreeMap::new(),
                finished: BTreeMap::new(),
                prompt_tokens: 0,
                generation_tokens: 0,
                running: 0,
                waiting: 0,
                ttft: Histogram::new(SECONDS),
                e2e: Histogram::new(SECONDS),
                tokens_per_s: Histogram::new(TOKENS_PER_S),
                spec: BTreeMap::new(),
            }),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        // A poisoned lock only means another thread panicked while counting.
        let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard)
    }

    /// Adds the drafters' names so their counters show (at zero) before any request.
    pub fn register_drafter(&self, name: &str) {
        self.with(|m| {
            m.spec.entry(name.to_owned()).or_default();
        });
    }

    pub fn http(&self, route: &str, status: u16) {
        self.with(|m| *m.http.entry((route.to_owned(), status)).or_default() += 1);
    }

    /// A request ended: `stop`, `length`, `abort` (the client left), `timeout` or `error`.
    pub fn finished(&self, reason: &str) {
        self.with(|m| *m.finished.entry(reason.to_owned()).or_default() += 1);
    }

    pub fn tokens(&self, prompt: usize, generated: usize) {
        self.with(|m| {
            m.prompt_tokens += prompt as u64;
            m.generation_tokens += generated as u64;
        });
    }

    pub fn set_queue(&self, running: usize, waiting: usize) {
        self.with(|m| {
            m.running = running;
            m.waiting = waiting;
        });
    }

    pub fn time_to_first_token(&self, seconds: f64) {
        self.with(|m| m.ttft.observe(seconds));
    }

    pub fn latency(&self, seconds: f64) {
        self.with(|m| m.e2e.observe(seconds));
    }

    pub fn tokens_per_second(&self, rate: f64) {
        self.with(|m| m.tokens_per_s.observe(rate));
    }

    /// Adds counters a request drafted (since its last report: the engine reports each round)
    /// to its drafter's.
    pub fn speculation(&self, drafter: &str, s: &SpecStats) {
        self.with(|m| {
            let t = m.spec.entry(drafter.to_owned()).or_default();
            t.num_drafts += s.num_drafts;
            t.num_draft_tokens += s.num_draft_tokens;
            t.num_accepted_tokens += s.num_accepted_tokens;
            if t.accepted_per_pos.len() < s.accepted_per_position.len() {
                t.accepted_per_pos.resize(s.accepted_per_position.len(), 0);
            }
            for (i, a) in s.accepted_per_position.iter().enumerate() {
                t.accepted_per_pos[i] += a;
            }
            if s.drafter_error.is_some() {
                t.drafter_errors += 1;
            }
        });
    }

    /// Requests running and waiting, as last set by the engine.
    pub fn queue(&self) -> (usize, usize) {
        self.with(|m| (m.running, m.waiting))
    }

    /// Everything in Prometheus' text exposition format.
    pub fn render(&self) -> String {
        self.with(|m| {
            let mut out = String::new();
            let p = "mlx_spec:";
            let head = |out: &mut String, name: &str, kind: &str, help: &str| {
                let _ = writeln!(out, "# HELP {p}{name} {help}\n# TYPE {p}{name} {kind}");
            };
            head(
                &mut out,
                "num_requests_running",
                "gauge",
                "Requests generating, taking turns round by round.",
            );
            let _ = writeln!(out, "{p}num_requests_running {}", m.running);
            head(
                &mut out,
                "num_requests_waiting",
                "gauge",
                "Requests waiting in the queue.",
            );
            let _ = writeln!(out, "{p}num_requests_waiting {}", m.waiting);
            head(
                &mut out,
                "http_requests_total",
                "counter",
                "HTTP requests by route and status.",
            );
            for ((route, status), n) in &m.http {
                let _ = writeln!(
                    out,
                    "{p}http_requests_total{{route=\"{}\",status=\"{status}\"}} {n}",
                    label(route)
                );
            }
            head(
                &mut out,
                "request_success_total",
                "counter",
                "Generation requests ended, by why they ended.",
            );
            for (reason, n) in &m.finished {
                let _ = writeln!(
                    out,
                    "{p}request_success_total{{finished_reason=\"{}\"}} {n}",
                    label(reason)
                );
            }
            head(
                &mut out,
                "prompt_tokens_total",
                "counter",
                "Prompt tokens of finished requests.",
            );
            let _ = writeln!(out, "{p}prompt_tokens_total {}", m.prompt_tokens);
            head(
                &mut out,
                "generation_tokens_total",
                "counter",
                "Tokens generated by finished requests.",
            );
            let _ = writeln!(out, "{p}generation_tokens_total {}", m.generation_tokens);
            m.ttft.render(
                &mut out,
                &format!("{p}time_to_first_token_seconds"),
                "Seconds from a request's arrival to its first token.",
            );
            m.e2e.render(
                &mut out,
                &format!("{p}e2e_request_latency_seconds"),
                "Seconds from a request's arrival to its last token.",
            );
            m.tokens_per_s.render(
                &mut out,
                &format!("{p}request_decode_tokens_per_second"),
                "Tokens a second of each request after its first token.",
            );
            let counters: [Counter; 4] = [
                (
                    "spec_decode_num_drafts_total",
                    "Rounds in which the drafter proposed tokens.",
                    |t| t.num_drafts,
                ),
                (
                    "spec_decode_num_draft_tokens_total",
                    "Tokens the drafter proposed.",
                    |t| t.num_draft_tokens,
                ),
                (
                    "spec_decode_num_accepted_tokens_total",
                    "Proposed tokens the target accepted.",
                    |t| t.num_accepted_tokens,
                ),
                (
                    "spec_decode_drafter_errors_total",
                    "Requests whose drafter failed and was switched off for the rest of them.",
                    |t| t.drafter_errors,
                ),
            ];
            for (name, help, get) in counters {
                head(&mut out, name, "counter", help);
                for (drafter, t) in &m.spec {
                    let _ = writeln!(out, "{p}{name}{{drafter=\"{}\"}} {}", label(drafter), get(t));
                }
            }
            head(
                &mut out,
                "spec_decode_num_accepted_tokens_per_pos_total",
                "counter",
                "Accepted drafts by their position in the round.",
            );
            for (drafter, t) in &m.spec {
                for (pos, n) in t.accepted_per_pos.iter().enumerate() {
                    let _ = writeln!(
                        out,
                        "{p}spec_decode_num_accepted_tokens_per_pos_total{{drafter=\"{}\",position=\"{pos}\"}} {n}",
                        label(drafter)
                    );
                }
            }
            out
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_histograms_render_as_prometheus_text() {
        let m = Metrics::new();
        m.register_drafter("ngram");
        m.http("/v1/completions", 200);
        m.finished("stop");
        m.time_to_first_token(0.03);
        m.time_to_first_token(2.0);
        m.speculation(
            "ngram",
            &SpecStats {
                num_drafts: 3,
                num_draft_tokens: 9,
                num_accepted_tokens: 4,
                accepted_per_position: vec![3, 1],
                ..SpecStats::default()
            },
        );
        let text = m.render();
        for line in [
            "mlx_spec:spec_decode_num_drafts_total{drafter=\"ngram\"} 3",
            "mlx_spec:spec_decode_num_draft_tokens_total{drafter=\"ngram\"} 9",
            "mlx_spec:spec_decode_num_accepted_tokens_total{drafter=\"ngram\"} 4",
            "mlx_spec:spec_decode_num_accepted_tokens_per_pos_total{drafter=\"ngram\",position=\"1\"} 1",
            "mlx_spec:http_requests_total{route=\"/v1/completions\",status=\"200\"} 1",
            "mlx_spec:request_success_total{finished_reason=\"stop\"} 1",
            "mlx_spec:time_to_first_token_seconds_bucket{le=\"0.05\"} 1",
            "mlx_spec:time_to_first_token_seconds_bucket{le=\"+Inf\"} 2",
            "mlx_spec:time_to_first_token_seconds_count 2",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        // Label values are escaped.
        m.register_drafter("a\"b\\c");
        assert!(m
            .render()
            .contains("spec_decode_num_drafts_total{drafter=\"a\\\"b\\\\c\"} 0"));
        // Every sample line belongs to a declared metric.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let name = l.split(['{', ' ']).next().unwrap();
            let base = name
                .trim_end_matches("_bucket")
                .trim_end_matches("_sum")
                .trim_end_matches("_count");
            assert!(
                text.contains(&format!("# TYPE {name} "))
                    || text.contains(&format!("# TYPE {base} ")),
                "{l}"
            );
        }
    }
}
