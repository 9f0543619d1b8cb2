//! The session through the plugin ABI, against a stand-in target that serves the oracle's
//! recordings: the description, the prompt's final-norm hidden states as taps, the donor K/V
//! of the two donor layers after the prefill, and the target checkpoint's scaled embeddings.
//! Round r0 is the clean case (no host quirks), so the session's own choice of visible donor
//! entries must reproduce transformers' drafts.

mod common;

use abi_stable::sabi_trait::TD_Opaque;
use abi_stable::std_types::{RErr, ROk, RResult, RSlice, RString, RVec};
use common::{Oracle, PAIRS};
use mlx_spec_assistant::settings::Settings;
use mlx_spec_assistant::AssistantDrafter;
use mlx_spec_plugin_api::abi::{
    DonorKv, DraftSourceBox, SamplingInfo, TapRows, TargetInfo, TargetPort, TargetPort_TO,
};
use mlx_spec_plugin_api::mlx_rs::Array;
use mlx_spec_plugin_api::sdk::provider_in_process;
use mlx_spec_plugin_api::target_spec::{
    AttentionSpec, DonorLayers, LayerKind, RopeSpec, TargetSpec,
};
use mlx_spec_plugin_api::tensor::{Tensor, TensorRef};

struct FakeTarget<'a> {
    oracle: &'a Oracle,
    spec: TargetSpec,
    position: u64,
}

fn spec_of(o: &Oracle) -> TargetSpec {
    let c = &o.target_config;
    let n = c["num_hidden_layers"].as_u64().unwrap() as usize;
    let kinds: Vec<LayerKind> = c["layer_types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| match t.as_str().unwrap() {
            "sliding_attention" => LayerKind::SlidingAttention,
            _ => LayerKind::FullAttention,
        })
        .collect();
    let donors = &o.meta["target"]["donor_layer"];
    let kv = c["num_key_value_heads"].as_u64().unwrap() as usize;
    let k_eq_v = c["attention_k_eq_v"].as_bool().unwrap_or(false);
    let full_kv = if k_eq_v {
        c["num_global_key_value_heads"].as_u64().unwrap() as usize
    } else {
        kv
    };
    TargetSpec {
        family: "gemma4".into(),
        fingerprint: 7,
        vocab_size: c["vocab_size"].as_u64().unwrap() as usize,
        hidden_size: o.hidden,
        num_layers: n,
        num_attention_heads: c["num_attention_heads"].as_u64().unwrap() as usize,
        layer_types: kinds,
        kv_source: (0..n).collect(),
        sliding: AttentionSpec {
            head_dim: c["head_dim"].as_u64().unwrap() as usize,
            num_kv_heads: kv,
            k_eq_v: false,
            rope: RopeSpec::Default { theta: 10_000.0 },
        },
        full: AttentionSpec {
            head_dim: c["global_head_dim"].as_u64().unwrap() as usize,
            num_kv_heads: full_kv,
            k_eq_v,
            rope: RopeSpec::Proportional {
                theta: 1e6,
                partial_rotary_factor: 0.25,
                factor: 1.0,
            },
        },
        sliding_window: c["sliding_window"].as_u64().unwrap() as usize,
        donor_layers: DonorLayers {
            sliding: donors["sliding"].as_u64().map(|x| x as usize),
            full: donors["full"].as_u64().map(|x| x as usize),
        },
        rms_norm_eps: 1e-6,
        final_logit_softcapping: c["final_logit_softcapping"].as_f64().map(|x| x as f32),
        embed_scale: (o.hidden as f32).sqrt(),
        dtype: "float32".into(),
        per_layer_input_size: 0,
        config: c.clone(),
    }
}

impl TargetPort for FakeTarget<'_> {
    fn position(&self) -> u64 {
        self.position
    }

    fn embed(&self, ids: RSlice<'_, u32>) -> RResult<Tensor, RString> {
        let rows: Vec<_> = ids.iter().map(|&t| self.oracle.embed(t)).collect();
        let joined = mlx_spec_plugin_api::mlx_rs::ops::concatenate(&rows, 0)
            .unwrap()
            .reshape(&[1, ids.len() as i32, -1])
            .unwrap();
        ROk(Tensor::from_array(joined))
    }

    fn logits_from_hidden(&self, _hidden: TensorRef<'_>) -> RResult<Tensor, RString> {
        RErr("not served by the stand-in".into())
    }

    fn describe(&self) -> RResult<RString, RString> {
        ROk(serde_json::to_string(&self.spec).unwrap().into())
    }

    /// The r0 donors (positions 0..P-1 after the prefill, as the host lends them).
    fn donor_kv(&self, layer: u32) -> RResult<DonorKv, RString> {
        let kind = if Some(layer as usize) == self.spec.donor_layers.sliding {
            "sliding"
        } else if Some(layer as usize) == self.spec.donor_layers.full {
            "full"
        } else {
            return RErr(format!("layer {layer} is not a donor").into());
        };
        let first = self.oracle.ints(&format!("r0.donor.{kind}.pos"))[0] as u64;
        ROk(DonorKv {
            keys: Tensor::from_array(self.oracle.array(&format!("r0.donor.{kind}.k"))),
            values: Tensor::from_array(self.oracle.array(&format!("r0.donor.{kind}.v"))),
            first_position: first,
        })
    }
}

fn info(spec: &TargetSpec) -> TargetInfo {
    TargetInfo {
        family: "gemma4".into(),
        fingerprint: 7,
        vocab_size: spec.vocab_size as u32,
        hidden_size: spec.hidden_size as u32,
        num_layers: spec.num_layers as u32,
    }
}

const GREEDY: SamplingInfo = SamplingInfo {
    temperature: 0.0,
    top_k: 0,
    top_p: 1.0,
    min_p: 0.0,
    seed: 0,
};

fn drafter(o: &Oracle, extra: serde_json::Value) -> AssistantDrafter {
    let mut config = serde_json::json!({"checkpoint": o.dir.join("assistant").to_str().unwrap()});
    for (k, v) in extra.as_object().unwrap() {
        config[k] = v.clone();
    }
    AssistantDrafter::new(Settings::parse(&config, &o.dir).unwrap()).unwrap()
}

fn open(
    o: &Oracle,
    target: &FakeTarget<'_>,
    extra: serde_json::Value,
) -> Result<DraftSourceBox, String> {
    open_with(o, target, extra, GREEDY)
}

fn open_with(
    o: &Oracle,
    target: &FakeTarget<'_>,
    extra: serde_json::Value,
    sampling: SamplingInfo,
) -> Result<DraftSourceBox, String> {
    let provider = provider_in_process(drafter(o, extra));
    match provider.open(
        info(&target.spec),
        TargetPort_TO::from_ptr(target, TD_Opaque),
        sampling,
    ) {
        ROk(s) => Ok(s),
        RErr(e) => Err(e.into_string()),
    }
}

/// Prompt taps, prefill, then one greedy draft call; returns the drafts (or the error).
fn round_0(
    o: &Oracle,
    target: &FakeTarget<'_>,
    extra: serde_json::Value,
    taps: bool,
) -> Result<Vec<u32>, String> {
    let (tokens, probs) = round_0_with(o, target, extra, taps, GREEDY)?;
    assert!(probs.is_none());
    Ok(tokens)
}

/// [`round_0`] with the request's sampling settings; also returns the distributions.
fn round_0_with(
    o: &Oracle,
    target: &FakeTarget<'_>,
    extra: serde_json::Value,
    taps: bool,
    sampling: SamplingInfo,
) -> Result<(Vec<u32>, Option<Array>), String> {
    let mut source = open_with(o, target, extra, sampling)?;
    let port = || TargetPort_TO::from_ptr(target, TD_Opaque);
    assert_eq!(
        source.tap_layers().as_slice(),
        &[target.spec.num_layers as i32]
    );
    let prompt: Vec<u32> = o.ints("prompt_ids").iter().map(|&t| t as u32).collect();
    if taps {
        let hidden = o
            .array("target_hidden")
            .reshape(&[prompt.len() as i32, -1])
            .unwrap();
        let rows = TapRows {
            first_position: 0,
            layers: RVec::from(vec![Tensor::from_array(hidden)]),
        };
        if let RErr(e) = source.receive_taps(rows) {
            return Err(e.into_string());
        }
    }
    if let RErr(e) = source.prefill(RSlice::from_slice(&prompt), port()) {
        return Err(e.into_string());
    }
    let history: Vec<u32> = o.ints("r0.input_ids").iter().map(|&t| t as u32).collect();
    let k = o.meta["k"].as_u64().unwrap() as u32;
    match source.draft(RSlice::from_slice(&history), k, 1, port()) {
        ROk(d) => Ok((
            d.tokens.into_vec(),
            d.probs.into_option().map(Tensor::into_array),
        )),
        RErr(e) => Err(e.into_string()),
    }
}

#[test]
fn the_session_reproduces_round_0_from_taps_and_donors() {
    for pair in PAIRS {
        let o = Oracle::open(pair);
        let target = FakeTarget {
            oracle: &o,
            spec: spec_of(&o),
            position: o.position("r0"),
        };
        let want: Vec<u32> = o
            .ints("r0.draft_tokens")
            .iter()
            .map(|&t| t as u32)
            .collect();
        let got = round_0(&o, &target, serde_json::json!({}), true).unwrap();
        println!("[{pair}] session drafts {got:?}, oracle {want:?}");
        assert_eq!(got, want, "{pair}");
        // The other conventions run too (their drafts may differ: acceptance decides).
        for extra in [
            serde_json::json!({"position": "previous"}),
            serde_json::json!({"sliding_keys": "window"}),
        ] {
            let got = round_0(&o, &target, extra.clone(), true).unwrap();
            assert_eq!(got.len(), want.len(), "{pair} {extra}");
        }
    }
}

#[test]
fn missing_taps_and_a_wrong_position_are_errors() {
    let o = Oracle::open("e");
    let mut target = FakeTarget {
        oracle: &o,
        spec: spec_of(&o),
        position: o.position("r0"),
    };
    let e = round_0(&o, &target, serde_json::json!({}), false).unwrap_err();
    assert!(e.contains("no hidden state"), "{e}");
    target.position += 1;
    let e = round_0(&o, &target, serde_json::json!({}), true).unwrap_err();
    assert!(e.contains("history holds"), "{e}");
}

type SpecEdit = Box<dyn Fn(&mut TargetSpec)>;

#[test]
fn a_target_the_checkpoint_was_not_made_for_is_refused() {
    let o = Oracle::open("dense");
    let base = spec_of(&o);
    let cases: Vec<(SpecEdit, &str)> = vec![
        (
            Box::new(|s| s.hidden_size = 128),
            "backbone_hidden_size is 64, the target's is hidden size 128",
        ),
        (
            Box::new(|s| s.vocab_size = 512),
            "vocabulary size is 256, the target's is 512",
        ),
        (
            Box::new(|s| s.full.num_kv_heads = 2),
            "full_attention kv head count is 1",
        ),
        (
            Box::new(|s| s.sliding.head_dim = 32),
            "sliding_attention head dim is 16",
        ),
        (
            Box::new(|s| s.full.rope = RopeSpec::Default { theta: 1e6 }),
            "full_attention RoPE",
        ),
        (
            Box::new(|s| s.sliding_window = 8),
            "sliding_window is 4, the target's is 8",
        ),
        (
            Box::new(|s| s.donor_layers.full = None),
            "no KV-owning layer",
        ),
    ];
    for (change, want) in cases {
        let mut spec = base.clone();
        change(&mut spec);
        let target = FakeTarget {
            oracle: &o,
            spec,
            position: 12,
        };
        let e = open(&o, &target, serde_json::json!({}))
            .err()
            .expect("refused");
        assert!(e.contains(want), "{e}\n  should contain: {want}");
    }
}

/// `sample_drafts` at a temperature above 0: drafts drawn from `softmax(logits / T)`, each
/// with its distribution, reproducible from the seed; greedy without distributions otherwise.
#[test]
fn sampled_drafts_come_with_their_distributions() {
    let on = || serde_json::json!({"sample_drafts": true});
    for pair in PAIRS {
        let o = Oracle::open(pair);
        let target = FakeTarget {
            oracle: &o,
            spec: spec_of(&o),
            position: o.position("r0"),
        };
        let greedy = round_0(&o, &target, serde_json::json!({}), true).unwrap();
        let hot = SamplingInfo {
            temperature: 1.5,
            seed: 42,
            ..GREEDY
        };
        let (tokens, probs) = round_0_with(&o, &target, on(), true, hot).unwrap();
        let probs = probs.expect("distributions with sample_drafts at T > 0");
        assert_eq!(probs.shape(), &[tokens.len() as i32, 256]);
        let q = common::floats(&probs);
        for (i, row) in q.chunks(256).enumerate() {
            let sum: f32 = row.iter().sum();
            assert!((sum - 1.0).abs() < 1e-4, "{pair} row {i} sums to {sum}");
            assert!(row[tokens[i] as usize] > 0.0, "{pair}: token {i} has q = 0");
        }
        let again = round_0_with(&o, &target, on(), true, hot).unwrap().0;
        assert_eq!(tokens, again, "{pair}: same seed, same drafts");
        let other_seeds: Vec<Vec<u32>> = (1..6)
            .map(|seed| {
                round_0_with(&o, &target, on(), true, SamplingInfo { seed, ..hot })
                    .unwrap()
                    .0
            })
            .collect();
        assert!(
            other_seeds.iter().any(|t| *t != tokens),
            "{pair}: drafts never change with the seed at T = 1.5"
        );
        // Nearly greedy temperature: the draws are the argmax.
        let cold = SamplingInfo {
            temperature: 1e-3,
            ..hot
        };
        assert_eq!(
            round_0_with(&o, &target, on(), true, cold).unwrap().0,
            greedy
        );
        // Off, or at temperature 0: greedy and no distributions.
        let (t, p) = round_0_with(&o, &target, serde_json::json!({}), true, hot).unwrap();
        assert!(p.is_none() && t == greedy, "{pair}: sample_drafts off");
        let (t, p) = round_0_with(&o, &target, on(), true, GREEDY).unwrap();
        assert!(p.is_none() && t == greedy, "{pair}: temperature 0");
        println!("[{pair}] sampled at T=1.5, seed 42: {tokens:?} (greedy {greedy:?})");
    }
}
