//! `--replay-drafts`: speculation with drafts replayed from the plain output, each right with
//! a set probability, against plain greedy decoding: what the verify loop gives at a known
//! acceptance on shapes no drafter accepts on (random weights).

use std::time::Instant;

use anyhow::{bail, Result};
use serde_json::json;

use crate::Cli;
use mlx_spec::bench::median;
use mlx_spec::bench::speculative::explain_mismatch;
use mlx_spec::bench::verify_curve::prime_windows;
use mlx_spec::generate::{generate, GenerateRequest};
use mlx_spec::model::gemma4::Gemma4Model;
use mlx_spec::sampler::SamplingParams;
use mlx_spec::speculative::{generate_speculative, GateMemory, SpecOptions};

/// One replayed case: drafts a round, the chance each is right, how rounds are sized and how
/// many layers a group the verify window goes to the device in (0: whole).
#[derive(Clone, Copy)]
pub(crate) struct ReplayCase {
    k: usize,
    p: f64,
    fitted: bool,
    handoff: usize,
}

impl ReplayCase {
    fn sizing(&self) -> &'static str {
        if self.fitted {
            "fitted"
        } else {
            "recent"
        }
    }

    fn handoff(&self) -> String {
        match self.handoff {
            0 => "whole".to_owned(),
            n => format!("{n} layers"),
        }
    }
}

/// Plain greedy decoding against speculation with replayed drafts (`--replay-drafts`): for
/// each draft length, hit rate, way of sizing rounds (recent acceptance, or fitted to the
/// measured costs) and hand-off of the verify window, side by side in every round, the
/// outputs checked equal.
pub(crate) fn report_replayed_drafts(
    model: &mut Gemma4Model,
    prompt: &[u32],
    args: &Cli,
) -> Result<()> {
    use mlx_spec::model::gemma4::RunSettings;
    use mlx_spec::speculative::replay::{expected_acceptance_length, ReplayDrafter};
    if args.lab.replay_draft_lengths.contains(&0) {
        bail!("--replay-draft-lengths: every length must be at least 1");
    }
    let request = GenerateRequest {
        prompt_ids: prompt.to_vec(),
        max_tokens: args.gen_tokens,
        sampling: SamplingParams::default(),
        stop_ids: Vec::new(),
        ignore_eos: true,
    };
    let configured = model.settings();
    let handoffs = if args.lab.replay_handoffs.is_empty() {
        vec![configured.handoff_layers]
    } else {
        args.lab.replay_handoffs.clone()
    };
    let mut cases = Vec::new();
    for &k in &args.lab.replay_draft_lengths {
        for &p in &args.lab.replay_drafts {
            for sizing in &args.lab.replay_sizings {
                for &handoff in &handoffs {
                    let fitted = sizing == "fitted";
                    cases.push(ReplayCase {
                        k,
                        p,
                        fitted,
                        handoff,
                    });
                }
            }
        }
    }
    // Per case: spec rates, then the last round's counters.
    let mut spec_rates = vec![Vec::new(); cases.len()];
    let mut last_stats = vec![mlx_spec::speculative::SpecStats::default(); cases.len()];
    // Per case: the slowest drafted round of the measured rounds, seconds.
    let mut slowest = vec![0.0f64; cases.len()];
    let mut plain_rates = Vec::new();
    let most_drafts = args
        .lab
        .replay_draft_lengths
        .iter()
        .copied()
        .max()
        .unwrap_or(1);
    prime_windows(model, prompt, most_drafts + 1, args.gen_tokens)?;
    for round in 0..=args.repeats {
        let start = Instant::now();
        let (plain_tokens, _) = generate(model, &request, |_| Ok(()))?;
        let plain_s = start.elapsed().as_secs_f64();
        if round > 0 {
            plain_rates.push(plain_tokens.len() as f64 / plain_s);
        }
        for (i, case) in cases.iter().enumerate() {
            let provider = ReplayDrafter::new(plain_tokens.clone(), case.p, 0x5eed)
                .map_err(anyhow::Error::msg)?
                .into_provider();
            let options = SpecOptions {
                num_draft_tokens: case.k,
                auto_off: true,
                fitted_draft_length: case.fitted,
            };
            model.set_settings(RunSettings {
                handoff_layers: case.handoff,
                ..model.settings()
            });
            let start = Instant::now();
            let spec = generate_speculative(
                model,
                &request,
                Some(&provider),
                options,
                &mut GateMemory::default(),
                |_| Ok(()),
            );
            let spec_s = start.elapsed().as_secs_f64();
            model.set_settings(configured);
            let (spec_tokens, _, stats) = spec?;
            if spec_tokens != plain_tokens {
                bail!(
                    "speculative output differs from plain output ({} replayed drafts right with probability {}, rounds sized by {}, handed over {}, round {round}; {}): this is a bug, please report it",
                    case.k,
                    case.p,
                    case.sizing(),
                    case.handoff(),
                    explain_mismatch(model, &request, &plain_tokens, &spec_tokens)
                );
            }
            let rate = spec_tokens.len() as f64 / spec_s;
            // Every round on stderr: a median of two hides which round was slow, and why.
            eprintln!(
                "replay {} drafts, right with {}, sized by {}, handed over {}, round {round}{}: {rate:.1} tok/s, {} drafted rounds in {:.0} ms (slowest {:.1} ms, window of {}), {} forwards",
                case.k,
                case.p,
                case.sizing(),
                case.handoff(),
                if round == 0 { " (warm-up)" } else { "" },
                stats.num_drafts,
                stats.drafted_round_seconds * 1e3,
                stats.slowest_round_seconds * 1e3,
                stats.slowest_round_window,
                stats.target_forwards
            );
            if round > 0 {
                spec_rates[i].push(rate);
                slowest[i] = slowest[i].max(stats.slowest_round_seconds);
            }
            last_stats[i] = stats;
        }
    }
    let plain = median(plain_rates);
    let rows: Vec<_> = cases
        .iter()
        .zip(spec_rates)
        .zip(&last_stats)
        .zip(&slowest)
        .map(|(((case, rates), stats), &slow)| (case, median(rates), stats, slow))
        .collect();
    if args.json {
        let cases: Vec<_> = rows
            .iter()
            .map(|(c, spec, s, slow)| {
                json!({"num_draft_tokens": c.k, "hit_rate": c.p, "draft_length": c.sizing(),
                       "handoff_layers": c.handoff,
                       "spec_tokens_per_s": spec, "speedup": spec / plain,
                       "mean_acceptance_length": s.mean_acceptance_length,
                       "expected_acceptance_length": expected_acceptance_length(c.p, c.k),
                       "num_drafts": s.num_drafts, "num_draft_tokens_total": s.num_draft_tokens,
                       "num_accepted_tokens": s.num_accepted_tokens, "target_forwards": s.target_forwards,
                       "slowest_round_ms": slow * 1e3})
            })
            .collect();
        println!(
            "{}",
            json!({"model": args.model.model.display().to_string(), "prompt_tokens": prompt.len(),
                   "gen_tokens": args.gen_tokens, "repeats": args.repeats, "plain_tokens_per_s": plain, "cases": cases})
        );
    } else {
        println!("| drafts a round (k) | each right with | rounds sized by | window handed over | plain tok/s | spec tok/s | speedup | acceptance length (expected) | drafted rounds | forwards | slowest round |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        for (c, spec, s, slow) in &rows {
            println!(
                "| {} | {} | {} | {} | {plain:.1} | {spec:.1} | {:.2}x | {:.2} ({:.2}) | {} | {} | {:.1} ms |",
                c.k,
                c.p,
                c.sizing(),
                c.handoff(),
                spec / plain,
                s.mean_acceptance_length,
                expected_acceptance_length(c.p, c.k),
                s.num_drafts,
                s.target_forwards,
                slow * 1e3
            );
        }
    }
    Ok(())
}
