//! Greedy decoding with the submit thread (`mlx_spec::submit`): one thread builds step n + 1
//! while a second hands step n to MLX. Forced on here, on the CPU, it must give transformers'
//! continuation on every fixture and exactly the tokens of one-thread decoding on a long run
//! of the default model (past its sliding window, so cache trims happen under it).
//!
//! The mode is process-wide, so this file holds a single test.

mod common;

use common::{default_model, fixture, Golden, FIXTURES};
use mlx_rs::Dtype;
use mlx_spec::generate::{generate, GenerateRequest, StopReason};
use mlx_spec::model::gemma4::{DtypeChoice, Gemma4Model};
use mlx_spec::sampler::SamplingParams;
use mlx_spec::submit::{set_mode, use_for_next_decode, SubmitMode};

fn request(prompt_ids: Vec<u32>, max_tokens: usize, stop_ids: Vec<u32>) -> GenerateRequest {
    GenerateRequest {
        prompt_ids,
        max_tokens,
        sampling: SamplingParams::default(),
        stop_ids,
        ignore_eos: false,
    }
}

#[test]
fn two_thread_greedy_decoding_gives_the_same_tokens() {
    set_mode(SubmitMode::On);
    assert!(use_for_next_decode());
    for name in FIXTURES {
        let model = Gemma4Model::load(&fixture(name), DtypeChoice::Fixed(Dtype::Float32), None)
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let golden = Golden::load(name);
        let prompt = golden.ids("prompt_ids");
        let want = golden.ids("greedy_ids");
        let (got, stats) = generate(&model, &request(prompt.clone(), want.len(), vec![]), |_| {
            Ok(())
        })
        .unwrap();
        assert_eq!(got, want, "{name}: two-thread greedy continuation differs");
        assert_eq!(stats.stop_reason, StopReason::Length);

        // A stop token ends generation just before its first occurrence, with the step after
        // it already queued on the submit thread.
        let stop = want[5];
        let first = want.iter().position(|&t| t == stop).unwrap();
        let (got, stats) =
            generate(&model, &request(prompt, want.len(), vec![stop]), |_| Ok(())).unwrap();
        assert_eq!(got, want[..first], "{name}: generation past the stop token");
        assert_eq!(stats.stop_token, Some(stop));
    }

    let model = Gemma4Model::load(&default_model(), DtypeChoice::Auto, None).unwrap();
    let window = model.config.sliding_window;
    let prompt: Vec<u32> = (0..24).map(|i| 300 + 7 * i).collect();
    let long = request(prompt, window + 40, vec![]);
    let (two_threads, _) = generate(&model, &long, |_| Ok(())).unwrap();
    set_mode(SubmitMode::Off);
    assert!(!use_for_next_decode());
    let (one_thread, _) = generate(&model, &long, |_| Ok(())).unwrap();
    assert_eq!(two_threads.len(), window + 40);
    assert_eq!(two_threads, one_thread, "two-thread decoding drifted");
}
