//! The OpenAI-style request bodies, read field by field so that every mistake is a 400 naming
//! its field, and the error body every failure answers with.

use serde_json::{json, Map, Value};

use crate::tokenizer::ChatMessage;

/// An OpenAI-style error: status, message, type, the field at fault and a code.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_owned()),
            code: None,
        }
    }

    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// What to generate from.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Text(String),
    Ids(Vec<u32>),
    Chat(Vec<ChatMessage>),
}

/// The `speculation` field.
#[derive(Debug, Clone, PartialEq)]
pub enum SpeculationChoice {
    Off,
    /// A drafter by name (`None`: the server's default drafter) and tokens per round
    /// (`None`: the drafter's).
    Drafter {
        name: Option<String>,
        num_draft_tokens: Option<usize>,
    },
}

/// One generation request as the client wrote it (before the server's defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub model: Option<String>,
    pub input: Input,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop_strings: Vec<String>,
    pub stop_ids: Vec<u32>,
    pub stream: bool,
    pub ignore_eos: bool,
    pub speculation: Option<SpeculationChoice>,
    /// Return each token's id, text and how it was made (accepted draft, bonus, ...).
    pub speculation_detail: bool,
}

/// Most `stop` entries a request may give.
pub const MAX_STOPS: usize = 16;

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The field, `None` when absent or null.
fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    match field(obj, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::invalid(
            key,
            format!("'{key}' must be a boolean, got {}", type_name(v)),
        )),
    }
}

fn opt_number(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    match field(obj, key) {
        None => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(v) => Err(ApiError::invalid(
            key,
            format!("'{key}' must be a number, got {}", type_name(v)),
        )),
    }
}

/// An integer field in `[min, max]`.
fn opt_int(
    obj: &Map<String, Value>,
    key: &str,
    min: i64,
    max: u64,
) -> Result<Option<u64>, ApiError> {
    let Some(v) = field(obj, key) else {
        return Ok(None);
    };
    let out_of_range = || {
        ApiError::invalid(
            key,
            format!("'{key}' must be an integer from {min} to {max}, got {v}"),
        )
    };
    match v {
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                if u <= max && (u as i128) >= min as i128 {
                    return Ok(Some(u));
                }
                return Err(out_of_range());
            }
            if n.as_i64().is_some() {
                return Err(out_of_range());
            }
            // A float with an integral value (e.g. 5.0) is accepted, as JSON has one number
            // type; anything else is not an integer.
            match n.as_f64() {
                Some(f) if f.fract() == 0.0 && f >= min as f64 && f <= max as f64 => {
                    Ok(Some(f as u64))
                }
                Some(f) if f.fract() == 0.0 => Err(out_of_range()),
                _ => Err(ApiError::invalid(
                    key,
                    format!("'{key}' must be an integer, got {v}"),
                )),
            }
        }
        other => Err(ApiError::invalid(
            key,
            format!("'{key}' must be an integer, got {}", type_name(other)),
        )),
    }
}

fn opt_f32_in(
    obj: &Map<String, Value>,
    key: &str,
    ok: impl Fn(f64) -> bool,
    range: &str,
) -> Result<Option<f32>, ApiError> {
    match opt_number(obj, key)? {
        None => Ok(None),
        Some(x) if ok(x) => Ok(Some(x as f32)),
        Some(x) => Err(ApiError::invalid(
            key,
            format!("'{key}' must be {range}, got {x}"),
        )),
    }
}

/// Fields of OpenAI's API that this server does not implement: a request that sets one to
/// anything but its neutral value is refused, not silently served differently.
fn refuse_unsupported(obj: &Map<String, Value>, chat: bool) -> Result<(), ApiError> {
    let unsupported = |key: &str, why: &str| {
        Err(ApiError::invalid(
            key,
            format!("'{key}' is not supported by this server{why}"),
        ))
    };
    if let Some(n) = opt_int(obj, "n", 0, u64::MAX)? {
        if n != 1 {
            return Err(ApiError::invalid(
                "n",
                format!("'n' must be 1 (one choice per request), got {n}"),
            ));
        }
    }
    if let Some(b) = opt_int(obj, "best_of", 0, u64::MAX)? {
        if b != 1 {
            return unsupported("best_of", " (only 1)");
        }
    }
    for key in [
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ] {
        if let Some(x) = opt_number(obj, key)? {
            let neutral = if key == "repetition_penalty" {
                1.0
            } else {
                0.0
            };
            if x != neutral {
                return unsupported(key, "");
            }
        }
    }
    match field(obj, "logprobs") {
        None | Some(Value::Bool(false)) => {}
        Some(_) => return unsupported("logprobs", ""),
    }
    if field(obj, "top_logprobs").is_some() {
        return unsupported("top_logprobs", "");
    }
    if opt_bool(obj, "echo")? == Some(true) {
        return unsupported("echo", "");
    }
    if let Some(s) = field(obj, "suffix") {
        if s.as_str() != Some("") {
            return unsupported("suffix", "");
        }
    }
    if let Some(b) = field(obj, "logit_bias") {
        if b.as_object().is_none_or(|m| !m.is_empty()) {
            return unsupported("logit_bias", "");
        }
    }
    for key in ["tools", "functions"] {
        if let Some(t) = field(obj, key) {
            if t.as_array().is_none_or(|a| !a.is_empty()) {
                return unsupported(key, "");
            }
        }
    }
    if let Some(f) = field(obj, "response_format") {
        if f.get("type").and_then(Value::as_str) != Some("text") {
            return unsupported("response_format", " (only {\"type\": \"text\"})");
        }
    }
    if !chat && field(obj, "messages").is_some() {
        return Err(ApiError::invalid(
            "messages",
            "'messages' belongs to /v1/chat/completions; /v1/completions takes 'prompt'",
        ));
    }
    if chat && field(obj, "prompt").is_some() {
        return Err(ApiError::invalid(
            "prompt",
            "'prompt' belongs to /v1/completions; /v1/chat/completions takes 'messages'",
        ));
    }
    Ok(())
}

fn token_ids(key: &str, items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .filter(|&id| id <= u32::MAX as u64)
                .map(|id| id as u32)
                .ok_or_else(|| {
                    ApiError::invalid(
                        key,
                        format!("'{key}' token ids must be non-negative integers, got {v}"),
                    )
                })
        })
        .collect()
}

fn prompt(obj: &Map<String, Value>) -> Result<Input, ApiError> {
    let bad = |what: &str| {
        ApiError::invalid(
            "prompt",
            format!("'prompt' must be a string or an array of token ids, got {what}"),
        )
    };
    match field(obj, "prompt") {
        None => Err(ApiError::invalid("prompt", "'prompt' is required")),
        Some(Value::String(s)) => Ok(Input::Text(s.clone())),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => Err(ApiError::invalid("prompt", "'prompt' is empty")),
            [Value::String(s)] => Ok(Input::Text(s.clone())),
            [Value::Array(ids)] => Ok(Input::Ids(token_ids("prompt", ids)?)),
            [Value::String(_) | Value::Array(_), ..] => Err(ApiError::invalid(
                "prompt",
                "'prompt' holds several prompts; this server takes one per request",
            )),
            ids => Ok(Input::Ids(token_ids("prompt", ids)?)),
        },
        Some(v) => Err(bad(type_name(v))),
    }
}

fn messages(obj: &Map<String, Value>) -> Result<Input, ApiError> {
    let items = match field(obj, "messages") {
        None => return Err(ApiError::invalid("messages", "'messages' is required")),
        Some(Value::Array(items)) => items,
        Some(v) => {
            return Err(ApiError::invalid(
                "messages",
                format!("'messages' must be an array, got {}", type_name(v)),
            ))
        }
    };
    if items.is_empty() {
        return Err(ApiError::invalid("messages", "'messages' is empty"));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let param = format!("messages[{i}]");
        let m = m
            .as_object()
            .ok_or_else(|| ApiError::invalid(&param, format!("'{param}' must be an object")))?;
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("system" | "user" | "assistant" | "model")) => r.to_owned(),
            Some("developer") => "system".to_owned(),
            Some(other) => {
                return Err(ApiError::invalid(
                    &format!("{param}.role"),
                    format!(
                        "'{param}.role' must be system, developer, user or assistant, got {other:?}"
                    ),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    &format!("{param}.role"),
                    format!("'{param}.role' is required and must be a string"),
                ))
            }
        };
        let content = match m.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    match (
                        part.get("type").and_then(Value::as_str),
                        part.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                &format!("{param}.content[{j}]"),
                                format!(
                                    "'{param}.content[{j}]' must be a text part {{\"type\": \"text\", \"text\": ...}}; this model reads text only"
                                ),
                            ))
                        }
                    }
                }
                text
            }
            Some(v) => {
                return Err(ApiError::invalid(
                    &format!("{param}.content"),
                    format!(
                        "'{param}.content' must be a string or an array of text parts, got {}",
                        type_name(v)
                    ),
                ))
            }
        };
        out.push(ChatMessage { role, content });
    }
    Ok(Input::Chat(out))
}

fn stops(obj: &Map<String, Value>) -> Result<(Vec<String>, Vec<u32>), ApiError> {
    let mut strings = Vec::new();
    let mut ids = Vec::new();
    let bad = || {
        ApiError::invalid(
            "stop",
            "'stop' must be a string or an array of strings and token ids",
        )
    };
    match field(obj, "stop") {
        None => {}
        Some(Value::String(s)) => strings.push(s.clone()),
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOPS {
                return Err(ApiError::invalid(
                    "stop",
                    format!("'stop' has {} entries; at most {MAX_STOPS}", items.len()),
                ));
            }
            for item in items {
                match item {
                    Value::String(s) => strings.push(s.clone()),
                    Value::Number(_) => ids.extend(token_ids("stop", std::slice::from_ref(item))?),
                    _ => return Err(bad()),
                }
            }
        }
        Some(_) => return Err(bad()),
    }
    if strings.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "'stop' strings must not be empty",
        ));
    }
    match field(obj, "stop_token_ids") {
        None => {}
        Some(Value::Array(items)) => ids.extend(token_ids("stop_token_ids", items)?),
        Some(v) => {
            return Err(ApiError::invalid(
                "stop_token_ids",
                format!("'stop_token_ids' must be an array, got {}", type_name(v)),
            ))
        }
    }
    Ok((strings, ids))
}

fn speculation(obj: &Map<String, Value>) -> Result<Option<SpeculationChoice>, ApiError> {
    match field(obj, "speculation") {
        None => Ok(None),
        Some(Value::String(s)) if s == "off" => Ok(Some(SpeculationChoice::Off)),
        Some(Value::Bool(false)) => Ok(Some(SpeculationChoice::Off)),
        Some(Value::Object(m)) => {
            for key in m.keys() {
                if key != "drafter" && key != "num_draft_tokens" {
                    return Err(ApiError::invalid(
                        &format!("speculation.{key}"),
                        format!("'speculation.{key}' is not a field of 'speculation' (drafter, num_draft_tokens)"),
                    ));
                }
            }
            let name = match field(m, "drafter") {
                None => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(v) => {
                    return Err(ApiError::invalid(
                        "speculation.drafter",
                        format!("'speculation.drafter' must be a string, got {}", type_name(v)),
                    ))
                }
            };
            let k = opt_int(m, "num_draft_tokens", 1, 64)
                .map_err(|e| {
                    ApiError::invalid(
                        "speculation.num_draft_tokens",
                        e.message.replace("'num_draft_tokens'", "'speculation.num_draft_tokens'"),
                    )
                })?
                .map(|k| k as usize);
            Ok(Some(SpeculationChoice::Drafter {
                name,
                num_draft_tokens: k,
            }))
        }
        Some(v) => Err(ApiError::invalid(
            "speculation",
            format!(
                "'speculation' must be \"off\" or {{\"drafter\": NAME, \"num_draft_tokens\": K}}, got {v}"
            ),
        )),
    }
}

/// Reads a request body of `/v1/completions` (`chat` false) or `/v1/chat/completions`.
/// `max_new_tokens` bounds `max_tokens`.
pub fn parse(body: &[u8], chat: bool, max_new_tokens: usize) -> Result<GenRequest, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            400,
            "invalid_request_error",
            format!("the request body is not valid JSON: {e}"),
        )
    })?;
    let obj = value.as_object().ok_or_else(|| {
        ApiError::new(
            400,
            "invalid_request_error",
            format!(
                "the request body must be a JSON object, got {}",
                type_name(&value)
            ),
        )
    })?;
    refuse_unsupported(obj, chat)?;
    let model = match field(obj, "model") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => {
            return Err(ApiError::invalid(
                "model",
                format!("'model' must be a string, got {}", type_name(v)),
            ))
        }
    };
    let input = if chat { messages(obj)? } else { prompt(obj)? };
    let key = if chat && field(obj, "max_completion_tokens").is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_tokens = opt_int(obj, key, 1, max_new_tokens as u64)?.map(|n| n as usize);
    let temperature = opt_f32_in(
        obj,
        "temperature",
        |t| (0.0..=100.0).contains(&t),
        "a number from 0 to 100",
    )?;
    let top_p = opt_f32_in(obj, "top_p", |p| p > 0.0 && p <= 1.0, "in (0, 1]")?;
    let min_p = opt_f32_in(obj, "min_p", |p| (0.0..=1.0).contains(&p), "in [0, 1]")?;
    // -1 is vLLM's "off", as 0 is here.
    let top_k = match field(obj, "top_k") {
        Some(v) if v.as_i64() == Some(-1) => Some(0),
        _ => opt_int(obj, "top_k", 0, 1 << 31)?.map(|k| k as usize),
    };
    let seed = opt_int(obj, "seed", 0, u64::MAX)?;
    let (stop_strings, stop_ids) = stops(obj)?;
    Ok(GenRequest {
        model,
        input,
        max_tokens,
        temperature,
        top_p,
        top_k,
        min_p,
        seed,
        stop_strings,
        stop_ids,
        stream: opt_bool(obj, "stream")?.unwrap_or(false),
        ignore_eos: opt_bool(obj, "ignore_eos")?.unwrap_or(false),
        speculation: speculation(obj)?,
        speculation_detail: opt_bool(obj, "speculation_detail")?.unwrap_or(false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion(body: &str) -> Result<GenRequest, ApiError> {
        parse(body.as_bytes(), false, 1000)
    }

    fn chat(body: &str) -> Result<GenRequest, ApiError> {
        parse(body.as_bytes(), true, 1000)
    }

    fn param_of(r: Result<GenRequest, ApiError>) -> String {
        let e = r.unwrap_err();
        assert_eq!(e.status, 400, "{e:?}");
        e.param.unwrap_or_default()
    }

    #[test]
    fn a_full_completion_request_is_read() {
        let r = completion(
            r#"{"model": "m", "prompt": "def f", "max_tokens": 7, "temperature": 0.5,
                "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 3, "stop": ["\n\n", 1],
                "stream": true, "n": 1, "user": "x",
                "speculation": {"drafter": "ngram", "num_draft_tokens": 4}}"#,
        )
        .unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.input, Input::Text("def f".into()));
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!((r.top_k, r.seed), (Some(40), Some(3)));
        assert_eq!(r.stop_strings, vec!["\n\n"]);
        assert_eq!(r.stop_ids, vec![1]);
        assert!(r.stream);
        assert_eq!(
            r.speculation,
            Some(SpeculationChoice::Drafter {
                name: Some("ngram".into()),
                num_draft_tokens: Some(4)
            })
        );
        let r = completion(r#"{"prompt": [2, 10, 20], "speculation": "off"}"#).unwrap();
        assert_eq!(r.input, Input::Ids(vec![2, 10, 20]));
        assert_eq!(r.speculation, Some(SpeculationChoice::Off));
    }

    #[test]
    fn chat_messages_take_strings_or_text_parts() {
        let r = chat(
            r#"{"messages": [{"role": "system", "content": "Be brief"},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                "max_completion_tokens": 5}"#,
        )
        .unwrap();
        let Input::Chat(m) = r.input else { panic!() };
        assert_eq!(
            (m[0].role.as_str(), m[1].content.as_str()),
            ("system", "Hi")
        );
        assert_eq!(r.max_tokens, Some(5));
    }

    #[test]
    fn every_bad_field_is_a_400_naming_it() {
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "max_tokens": -1}"#)),
            "max_tokens"
        );
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "max_tokens": 1001}"#)),
            "max_tokens"
        );
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "max_tokens": 0}"#)),
            "max_tokens"
        );
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "max_tokens": "9"}"#)),
            "max_tokens"
        );
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "max_tokens": 1.5}"#)),
            "max_tokens"
        );
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "temperature": -0.1}"#)),
            "temperature"
        );
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "top_p": 0}"#)),
            "top_p"
        );
        assert_eq!(param_of(completion(r#"{"prompt": "x", "n": 2}"#)), "n");
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "seed": -4}"#)),
            "seed"
        );
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "stop": [""]}"#)),
            "stop"
        );
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "stop": {"a": 1}}"#)),
            "stop"
        );
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "stream": "yes"}"#)),
            "stream"
        );
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "logprobs": 2}"#)),
            "logprobs"
        );
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "echo": true}"#)),
            "echo"
        );
        assert_eq!(param_of(completion(r#"{"prompt": [-1]}"#)), "prompt");
        assert_eq!(param_of(completion(r#"{"prompt": ["a", "b"]}"#)), "prompt");
        assert_eq!(param_of(completion(r#"{"prompt": 5}"#)), "prompt");
        assert_eq!(param_of(completion(r#"{}"#)), "prompt");
        assert_eq!(
            param_of(completion(
                r#"{"prompt": "x", "speculation": {"drafter": 3}}"#
            )),
            "speculation.drafter"
        );
        assert_eq!(
            param_of(completion(
                r#"{"prompt": "x", "speculation": {"num_draft_tokens": 0}}"#
            )),
            "speculation.num_draft_tokens"
        );
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "speculation": {"k": 3}}"#)),
            "speculation.k"
        );
        assert_eq!(
            param_of(completion(r#"{"prompt": "x", "speculation": "on"}"#)),
            "speculation"
        );
        assert_eq!(param_of(chat(r#"{"messages": []}"#)), "messages");
        assert_eq!(
            param_of(chat(r#"{"messages": [{"role": "tool", "content": "x"}]}"#)),
            "messages[0].role"
        );
        assert_eq!(
            param_of(chat(
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#
            )),
            "messages[0].content[0]"
        );
        assert_eq!(
            param_of(chat(
                r#"{"prompt": "x", "messages": [{"role": "user", "content": "x"}]}"#
            )),
            "prompt"
        );
        // Not JSON, or not an object: a 400 without a field.
        for body in ["{", "[1]", "\u{0}", ""] {
            let e = completion(body).unwrap_err();
            assert_eq!((e.status, e.param.clone()), (400, None), "{body:?}: {e:?}");
        }
        // The error body has OpenAI's shape.
        let e = completion(r#"{"prompt": "x", "n": 3}"#).unwrap_err();
        let body = e.body();
        assert_eq!(body["error"]["param"], "n");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(body["error"]["message"].as_str().unwrap().contains("'n'"));
    }
}
