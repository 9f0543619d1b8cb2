//! Tokenizer, chat format and streaming detokenization against transformers' tokenizer
//! (goldens in tests/fixtures/tiny-wrapped-bf16/tokenizer_golden.json).

mod common;

use common::fixture;
use mlx_spec::tokenizer::{stop_ids, ChatMessage, StreamDecoder, Tokenizer, BOS_ID};
use serde_json::Value;

fn golden() -> Value {
    let path = fixture("tiny-wrapped-bf16").join("tokenizer_golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(&fixture("tiny-wrapped-bf16"), Some(BOS_ID))
        .unwrap()
        .expect("fixture has tokenizer.json")
}

#[test]
fn prompt_encoding_matches_transformers_with_one_bos() {
    let g = golden();
    let tok = tokenizer();
    let got = tok.encode_prompt(g["text"].as_str().unwrap()).unwrap();
    assert_eq!(got, ids(&g["ids"]));
    assert_eq!(
        got.iter().filter(|&&i| i == BOS_ID).count(),
        1,
        "BOS must not be doubled"
    );
    assert_eq!(tok.decode(&got).unwrap(), g["text"].as_str().unwrap());
}

#[test]
fn chat_encoding_matches_transformers_template() {
    let g = golden();
    let tok = tokenizer();
    let got = tok
        .encode_chat(&[ChatMessage {
            role: "user".into(),
            content: "Hi there".into(),
        }])
        .unwrap();
    assert_eq!(got, ids(&g["chat_ids"]));
    for (token, id) in [
        ("<|turn>", 105),
        ("<turn|>", 106),
        ("<bos>", 2),
        ("<eos>", 1),
    ] {
        assert_eq!(tok.token_to_id(token), Some(id), "{token}");
    }
}

#[test]
fn streaming_pieces_concatenate_to_the_full_text() {
    let g = golden();
    let tok = tokenizer();
    let all = ids(&g["ids_no_special"]);
    let mut stream = StreamDecoder::new();
    let mut text = String::new();
    for &id in &all {
        let piece = stream.push(&tok, id).unwrap();
        assert!(
            !piece.contains('\u{FFFD}'),
            "a piece split a UTF-8 character: {piece:?}"
        );
        text.push_str(&piece);
    }
    assert_eq!(text, g["text"].as_str().unwrap());
}

/// Cut anywhere, even inside a character whose bytes are separate tokens, the streamed pieces
/// plus `finish` are the decoded text of what was generated.
#[test]
fn streaming_then_finish_gives_the_decoded_text_at_every_cut() {
    let g = golden();
    let tok = tokenizer();
    let all = ids(&g["ids_no_special"]);
    let mut held_back_somewhere = false;
    for cut in 1..=all.len() {
        let mut stream = StreamDecoder::new();
        let mut text = String::new();
        for &id in &all[..cut] {
            text.push_str(&stream.push(&tok, id).unwrap());
        }
        let tail = stream.finish(&tok).unwrap();
        held_back_somewhere |= !tail.is_empty();
        text.push_str(&tail);
        assert_eq!(
            text,
            tok.decode(&all[..cut]).unwrap(),
            "cut after {cut} tokens"
        );
    }
    assert!(
        held_back_somewhere,
        "no cut fell inside a character: the text checks nothing held back"
    );
}

#[test]
fn stop_ids_merge_config_and_generation_config() {
    let stops = stop_ids(&fixture("tiny-wrapped-bf16"), &[1, 106]).unwrap();
    assert_eq!(stops, vec![1, 106, 50]);
}

#[test]
fn model_without_tokenizer_json_has_none() {
    assert!(
        Tokenizer::from_dir(&fixture("tiny-ple-kvshare"), Some(BOS_ID))
            .unwrap()
            .is_none()
    );
}
