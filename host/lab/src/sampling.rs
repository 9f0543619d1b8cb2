//! `--compare-sampling`: what drawing tokens costs a decode step, drawn on the device and on
//! the host.

use anyhow::Result;
use serde_json::json;

use crate::Cli;
use mlx_spec::bench::median;
use mlx_spec::generate::{generate, GenerateRequest};
use mlx_spec::model::gemma4::Gemma4Model;
use mlx_spec::sampler::SamplingParams;

/// Plain decoding greedy and with several sampling settings (`--compare-sampling`), each
/// drawn on the device and on the host, alternated in one process: decode tokens a second,
/// median over `--repeats` rounds after one warm-up round.
pub(crate) fn report_sampling(model: &Gemma4Model, prompt: &[u32], args: &Cli) -> Result<()> {
    use mlx_spec::sampler::DrawPlace;
    let sampled = |temperature, top_k, top_p, min_p| SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: 11,
        draw: DrawPlace::Device,
    };
    let settings = [
        ("greedy", SamplingParams::default()),
        ("temperature 0.8", sampled(0.8, 0, 1.0, 0.0)),
        ("temperature 0.8, top-p 0.95", sampled(0.8, 0, 0.95, 0.0)),
        (
            "temperature 1.0, top-k 64, top-p 0.95 (Gemma 4's own)",
            sampled(1.0, 64, 0.95, 0.0),
        ),
        (
            "temperature 0.8, top-k 64, top-p 0.95, min-p 0.05",
            sampled(0.8, 64, 0.95, 0.05),
        ),
    ];
    // (setting, drawn on the host): greedy draws nowhere but the device.
    let cases: Vec<(usize, bool)> = (0..settings.len())
        .flat_map(|i| {
            let ways: &[bool] = if i == 0 { &[false] } else { &[false, true] };
            ways.iter().map(move |&host| (i, host))
        })
        .collect();
    let mut rates = vec![Vec::new(); cases.len()];
    for round in 0..=args.repeats {
        for (c, &(i, host)) in cases.iter().enumerate() {
            let request = GenerateRequest {
                prompt_ids: prompt.to_vec(),
                max_tokens: args.gen_tokens,
                sampling: SamplingParams {
                    draw: if host {
                        DrawPlace::Host
                    } else {
                        DrawPlace::Device
                    },
                    ..settings[i].1
                },
                stop_ids: Vec::new(),
                ignore_eos: true,
            };
            let (_, stats) = generate(model, &request, |_| Ok(()))?;
            if round > 0 {
                rates[c].push(stats.decode_tokens_per_s);
            }
        }
    }
    let rates: Vec<f64> = rates.into_iter().map(median).collect();
    let greedy = rates[0];
    let drawn = |host: bool| if host { "host" } else { "device" };
    if args.json {
        let rows: Vec<_> = cases
            .iter()
            .zip(&rates)
            .map(|(&(i, host), rate)| json!({"sampling": settings[i].0, "drawn_on": drawn(host),
                                             "decode_tokens_per_s": rate, "of_greedy": rate / greedy}))
            .collect();
        println!(
            "{}",
            json!({"model": args.model.model.display().to_string(), "prompt_tokens": prompt.len(),
                   "gen_tokens": args.gen_tokens, "repeats": args.repeats, "sampling": rows})
        );
    } else {
        println!("| sampling | drawn on | decode tok/s | of greedy |");
        println!("|---|---|---|---|");
        for (&(i, host), rate) in cases.iter().zip(&rates) {
            println!(
                "| {} | {} | {rate:.1} | {:.2}x |",
                settings[i].0,
                drawn(host),
                rate / greedy
            );
        }
    }
    Ok(())
}
