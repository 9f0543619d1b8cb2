//! Parity with transformers on the recorded oracle rounds (float32, tolerance 1e-4).
//!
//! Every round is chained on the drafter's OWN outputs from the recorded anchor (token and
//! target hidden), with the donors and visibility masks as transformers handed them; the
//! token embeddings come from the target checkpoint (`embed_tokens` × sqrt(H)), and the
//! recorded concatenated input checks that they were put first.

mod common;

use common::{floats, max_diff, Oracle, PAIRS};
use mlx_spec_assistant::attention::AttentionScale;
use mlx_spec_plugin_api::mlx_rs::Array;

const TOL: f32 = 1e-4;

#[test]
fn round_0_every_intermediate_matches() {
    for pair in PAIRS {
        let o = Oracle::open(pair);
        let model = o.model();
        assert_eq!(model.head.is_centroid(), pair == "e", "{pair}: head kind");
        let round = o.round(&model, "r0", 0);
        let (tokens, steps) = o.chain(&model, "r0", &round);
        let (mut worst_input, mut worst_stream, mut worst_logit, mut worst_next) =
            (0f32, 0f32, 0f32, 0f32);
        for (t, out) in steps.iter().enumerate() {
            let s = |name: &str| o.floats(&format!("r0.s{t}.{name}"));
            worst_input = worst_input.max(max_diff(&floats(&out.input), &s("inputs_embeds")));
            // hs0: after the input projection; hs1..hs3: after layers 0..2; hs4: final norm.
            for (i, h) in out.stream[..4].iter().enumerate() {
                worst_stream = worst_stream.max(max_diff(&floats(h), &s(&format!("hs{i}"))));
            }
            worst_stream = worst_stream.max(max_diff(&floats(&out.normed), &s("hs4")));
            let logits = model.head.logits(&out.normed).unwrap();
            worst_logit = worst_logit.max(max_diff(&floats(&logits), &s("logits")));
            worst_next = worst_next.max(max_diff(&floats(&out.next_hidden), &s("next_hidden")));
            assert_eq!(
                tokens[t] as i64,
                o.ints(&format!("r0.s{t}.token"))[0],
                "{pair} step {t}"
            );
        }
        let want: Vec<u32> = o
            .ints("r0.draft_tokens")
            .iter()
            .map(|&t| t as u32)
            .collect();
        println!(
            "[{pair}] r0: max |d input| {worst_input:.2e}, |d hidden states| {worst_stream:.2e}, |d logits| {worst_logit:.2e}, |d next hidden| {worst_next:.2e}; tokens {tokens:?}"
        );
        assert_eq!(tokens, want, "{pair}: r0 drafts");
        for (what, worst) in [
            ("input", worst_input),
            ("hidden states", worst_stream),
            ("logits", worst_logit),
            ("next hidden", worst_next),
        ] {
            assert!(worst <= TOL, "{pair} r0 {what}: {worst:e} > {TOL:e}");
        }
    }
}

#[test]
fn later_rounds_with_transformers_masks_match() {
    for pair in PAIRS {
        let o = Oracle::open(pair);
        let model = o.model();
        let rounds = o.rounds();
        assert!(
            rounds.len() >= 4,
            "{pair}: expected rounds r0..r3, found {rounds:?}"
        );
        for r in rounds.iter().skip(1) {
            let inputs = o.round(&model, r, 0);
            let (tokens, steps) = o.chain(&model, r, &inputs);
            let mut worst = 0f32;
            for (t, out) in steps.iter().enumerate() {
                let logits = model.head.logits(&out.normed).unwrap();
                worst = worst.max(max_diff(
                    &floats(&logits),
                    &o.floats(&format!("{r}.s{t}.logits")),
                ));
            }
            let want: Vec<u32> = o
                .ints(&format!("{r}.draft_tokens"))
                .iter()
                .map(|&t| t as u32)
                .collect();
            println!(
                "[{pair}] {r}: P={} max |d logits| {worst:.2e}; tokens {tokens:?}",
                o.position(r)
            );
            assert_eq!(tokens, want, "{pair} {r}: drafts");
            assert!(worst <= TOL, "{pair} {r}: logits differ by {worst:e}");
        }
    }
}

/// What the oracle must tell apart: the attention scale 1/sqrt(head_dim) (mlx-bun's), the
/// query at P − 1, and the embedding without its sqrt(H) scale.
#[test]
fn negative_controls_fail() {
    for pair in PAIRS {
        let o = Oracle::open(pair);
        let want = o.floats("r0.s0.logits");
        let (token, hidden) = o.anchor("r0");
        let step0 = |model: &mlx_spec_assistant::AssistantModel, shift: i64, embed_scale: f32| {
            let round = o.round(model, "r0", shift);
            let e = o
                .embed(token)
                .multiply(Array::from_f32(embed_scale))
                .unwrap();
            let out = model.step(&e, &hidden, &round).unwrap();
            max_diff(&floats(&model.head.logits(&out.normed).unwrap()), &want)
        };
        let mut model = o.model();
        let exact = step0(&model, 0, 1.0);
        let previous = step0(&model, -1, 1.0);
        let unscaled = step0(&model, 0, 1.0 / (o.hidden as f32).sqrt());
        model.attention_scale = AttentionScale::InverseSqrtHeadDim;
        let scaled = step0(&model, 0, 1.0);
        println!(
            "[{pair}] step-0 max |d logits|: as specified {exact:.2e}; scale hd^-0.5 {scaled:.3}; position P-1 {previous:.3}; unscaled embedding {unscaled:.3}"
        );
        assert!(exact <= TOL);
        for (what, d) in [
            ("scale hd^-0.5", scaled),
            ("P - 1", previous),
            ("unscaled embedding", unscaled),
        ] {
            assert!(
                d > 1e-2,
                "{pair}: {what} should not match the oracle (differs by {d:e})"
            );
        }
    }
}
