//! Reading a drafter's settings (`plugin.toml` `[defaults]` merged with `--drafter-set` keys)
//! into the plugin's own struct, with errors that name the key at fault.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

/// Deserializes `config` into `T`; on failure the error names the drafter and, where one key
/// alone is at fault, that key (serde's message for a value of the wrong type names only the
/// type it expected, which leaves a user guessing which of several keys to fix).
pub fn parse_settings<T: DeserializeOwned>(config: &Value, drafter: &str) -> Result<T, String> {
    let whole = match serde_json::from_value::<T>(config.clone()) {
        Ok(parsed) => return Ok(parsed),
        Err(e) => e.to_string(),
    };
    if let Value::Object(entries) = config {
        for (key, value) in entries {
            let alone = Value::Object(Map::from_iter([(key.clone(), value.clone())]));
            if let Err(e) = serde_json::from_value::<T>(alone) {
                let message = e.to_string();
                // A struct with required keys refuses any single key for lacking the others.
                if !message.starts_with("missing field") {
                    return Err(format!("{drafter} drafter: setting `{key}`: {message}"));
                }
            }
        }
    }
    Err(format!("{drafter} drafter settings: {whole}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Example {
        depth: Option<u32>,
        name: Option<String>,
    }

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Required {
        depth: u32,
        name: String,
    }

    #[test]
    fn errors_name_the_drafter_and_the_key_at_fault() {
        let ok: Example = parse_settings(&json!({"depth": 3}), "demo").unwrap();
        assert_eq!(ok.depth, Some(3));
        let e = parse_settings::<Example>(&json!({"depth": 3, "name": 7}), "demo").unwrap_err();
        assert!(e.starts_with("demo drafter: setting `name`:"), "{e}");
        let e = parse_settings::<Example>(&json!({"depht": 3}), "demo").unwrap_err();
        assert!(e.contains("`depht`") && e.contains("unknown field"), "{e}");
        // With required keys a single key cannot be tried alone: the whole message stands.
        let e = parse_settings::<Required>(&json!({"depth": 3}), "demo").unwrap_err();
        assert_eq!(e, "demo drafter settings: missing field `name`");
        let e =
            parse_settings::<Required>(&json!({"depth": "x", "name": "a"}), "demo").unwrap_err();
        assert!(e.contains("invalid type"), "{e}");
    }
}
