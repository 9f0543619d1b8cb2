//! What operations cost the host (`--op-cost`) and how fast a feed-forward block streams its
//! weights (`--feed-forward-speed`).

use anyhow::Result;
use serde_json::json;

use crate::Cli;
use mlx_spec::device::{self};
use mlx_spec::load::read_config;

pub(crate) fn run_op_cost(args: &Cli) -> Result<()> {
    device::select(args.model.device)?;
    let costs =
        crate::diagnostics::operation_costs(400, 1024, args.repeats, args.model.fused_here())?;
    if args.json {
        let rows: Vec<_> = costs
            .iter()
            .map(|c| {
                json!({"kind": c.kind, "build_us": c.build_us, "submit_us": c.submit_us,
                       "total_us": c.total_us})
            })
            .collect();
        println!("{}", json!({ "op_cost": rows }));
        return Ok(());
    }
    println!("| operation | build µs/op | async_eval µs/op | total µs/op |");
    println!("|---|---|---|---|");
    for c in &costs {
        println!(
            "| {} | {:.2} | {:.2} | {:.2} |",
            c.kind, c.build_us, c.submit_us, c.total_us
        );
    }
    Ok(())
}

/// `mlx-spec-lab --feed-forward-speed`: the feed-forward block's weight streaming rate, by method.
pub(crate) fn run_feed_forward_speed(args: &Cli) -> Result<()> {
    device::select(args.model.device)?;
    let (_, _, config) = read_config(&args.model.model)?;
    let (hidden, intermediate) = (config.hidden_size as i32, config.intermediate_size as i32);
    // The first layer's heads (a sliding-window layer in every released size).
    let head_dim = config.layers.first().map_or(0, |l| l.head_dim);
    let attention_width = (config.num_heads * head_dim) as i32;
    let speeds = crate::diagnostics::feed_forward_speed(
        hidden,
        intermediate,
        attention_width,
        16,
        args.repeats,
        args.model.fused_here(),
    )?;
    if args.json {
        let rows: Vec<_> = speeds
            .iter()
            .map(|s| {
                json!({"kind": s.kind, "build_us": s.build_us, "submit_us": s.submit_us,
                       "total_us": s.total_us, "gb_per_s": s.gb_per_s})
            })
            .collect();
        println!(
            "{}",
            json!({ "feed_forward_speed": rows, "hidden": hidden, "intermediate": intermediate })
        );
        return Ok(());
    }
    println!(
        "feed-forward block, hidden {hidden}, intermediate {intermediate} (attention output \
         {attention_width} wide in the last rows), bf16, 16 layers:"
    );
    println!("| method | build µs/layer | async_eval µs/layer | total µs/layer | GB/s |");
    println!("|---|---|---|---|---|");
    for s in &speeds {
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} |",
            s.kind, s.build_us, s.submit_us, s.total_us, s.gb_per_s
        );
    }
    Ok(())
}
