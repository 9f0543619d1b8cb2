//! Fitting a block drafter's confidence thresholds from its own rounds (`mlx-spec calibrate`).
//!
//! A DSpark drafter's confidence head scores each row of the block it drafts, and the plugin
//! proposes the block up to its first row whose confidence is below that row's threshold.
//! Uncalibrated, it proposes the whole block. Calibration runs the drafter uncut over a prompt
//! set with a calibration log (one line a verified round: the block's confidences, the drafts
//! proposed and accepted) and fits each row's threshold from those outcomes.
//!
//! Row k's samples are the rounds that proposed it and accepted every draft before it (the
//! only rounds in which its fate mattered); its outcome is whether it was accepted too. The
//! chance of acceptance given the confidence is fitted as a non-decreasing step function
//! (isotonic regression by pooling adjacent violators), and the threshold is the lowest
//! confidence at which that chance reaches `min_acceptance`: a draft less likely than that to
//! be accepted costs a verify slot for too little. Rows reached too rarely to fit keep the
//! threshold of the row before them.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// One verified round of a calibration log.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Round {
    /// The confidence of every row of the drafted block.
    pub confidence: Vec<f32>,
    /// Drafts proposed (a prefix of the block).
    pub proposed: usize,
    /// Drafts accepted (a prefix of the proposed ones).
    pub accepted: usize,
}

/// Reads a calibration log (JSON lines), refusing a line that is not a round or whose counts
/// do not fit its block.
pub fn read_rounds(path: &Path) -> Result<Vec<Round>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the calibration log {}", path.display()))?;
    let mut rounds = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let where_ = || format!("{} line {}", path.display(), i + 1);
        let round: Round = serde_json::from_str(line)
            .with_context(|| format!("{}: not a calibration round", where_()))?;
        if round.accepted > round.proposed || round.proposed > round.confidence.len() {
            bail!(
                "{}: {} accepted of {} proposed drafts from a block of {} rows",
                where_(),
                round.accepted,
                round.proposed,
                round.confidence.len()
            );
        }
        rounds.push(round);
    }
    Ok(rounds)
}

/// What the fit found for one row of the block.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RowFit {
    pub row: usize,
    /// Rounds that proposed this row after accepting every draft before it.
    pub samples: usize,
    /// Of those, the rounds that accepted it.
    pub accepted: usize,
    pub threshold: f32,
    /// Too few samples: the threshold is the row before's.
    pub inherited: bool,
}

/// Per-row thresholds (one per block row) and how each was found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fit {
    pub thresholds: Vec<f32>,
    pub rows: Vec<RowFit>,
}

/// The threshold that drops every draft of a row: the plugin keeps a row whose confidence is
/// at least its threshold, and thresholds lie in [0, 1).
const DROP_ALL: f32 = 0.999;

/// Fits one threshold a block row from `rounds` (see the module's comment). Rows with fewer
/// than `min_samples` samples inherit the row before's threshold; the first row must have
/// them.
pub fn fit_thresholds(rounds: &[Round], min_acceptance: f64, min_samples: usize) -> Result<Fit> {
    if !(0.0..=1.0).contains(&min_acceptance) {
        bail!("the least chance of acceptance must be in [0, 1], got {min_acceptance}");
    }
    let rows = rounds.iter().map(|r| r.confidence.len()).max().unwrap_or(0);
    if rows == 0 {
        bail!("no round with confidences to fit: was the drafter run with a confidence head?");
    }
    let mut fits: Vec<RowFit> = Vec::with_capacity(rows);
    for row in 0..rows {
        // (confidence, accepted) of the rounds whose fate reached this row.
        let mut points: Vec<(f32, bool)> = rounds
            .iter()
            .filter(|r| r.proposed > row && r.accepted >= row)
            .map(|r| (r.confidence[row], r.accepted > row))
            .collect();
        let samples = points.len();
        let accepted = points.iter().filter(|(_, a)| *a).count();
        let (threshold, inherited) = if samples >= min_samples {
            (
                lowest_confidence_reaching(&mut points, min_acceptance),
                false,
            )
        } else if let Some(before) = fits.last() {
            (before.threshold, true)
        } else {
            bail!(
                "only {samples} drafted rounds to fit the first row from (at least {min_samples} are needed): calibrate over more prompts or tokens"
            );
        };
        fits.push(RowFit {
            row,
            samples,
            accepted,
            threshold,
            inherited,
        });
    }
    Ok(Fit {
        thresholds: fits.iter().map(|f| f.threshold).collect(),
        rows: fits,
    })
}

/// The lowest confidence from which the isotonic fit of acceptance on confidence reaches
/// `min_acceptance` (0 when every confidence does, [`DROP_ALL`] when none does).
fn lowest_confidence_reaching(points: &mut [(f32, bool)], min_acceptance: f64) -> f32 {
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    // Pools of adjacent points, lowest confidence first: (lowest confidence, accepted, count).
    let mut pools: Vec<(f32, f64, f64)> = Vec::new();
    for &(c, a) in points.iter() {
        pools.push((c, f64::from(u8::from(a)), 1.0));
        // Merge while a pool's rate is below the one before it (the fit must not decrease).
        while pools.len() >= 2 {
            let (_, a1, n1) = pools[pools.len() - 1];
            let (c0, a0, n0) = pools[pools.len() - 2];
            if a1 / n1 >= a0 / n0 {
                break;
            }
            pools.pop();
            *pools.last_mut().unwrap() = (c0, a0 + a1, n0 + n1);
        }
    }
    match pools.iter().position(|&(_, a, n)| a / n >= min_acceptance) {
        Some(0) => 0.0,
        Some(i) => pools[i].0,
        None => DROP_ALL,
    }
}

/// What a cut would have proposed and accepted on recorded rounds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Replayed {
    pub rounds: usize,
    pub proposed: usize,
    pub accepted: usize,
}

/// Replays `thresholds` on uncut rounds: each round proposes up to its first row below its
/// threshold (as the plugin cuts), and keeps the accepted drafts within that.
pub fn replay(rounds: &[Round], thresholds: &[f32]) -> Replayed {
    let mut out = Replayed {
        rounds: rounds.len(),
        proposed: 0,
        accepted: 0,
    };
    for r in rounds {
        let cut = r
            .confidence
            .iter()
            .enumerate()
            .position(|(k, &c)| {
                let t = thresholds
                    .get(k)
                    .or(thresholds.last())
                    .copied()
                    .unwrap_or(0.0);
                t > 0.0 && c < t
            })
            .unwrap_or(r.confidence.len());
        let proposed = cut.min(r.proposed);
        out.proposed += proposed;
        out.accepted += r.accepted.min(proposed);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounds of a block of `rows` rows whose row k is accepted (given the ones before) exactly
    /// when its confidence is at least `edge[k]`; confidences spread evenly over (0, 1).
    fn rounds_with_edges(edge: &[f32], count: usize) -> Vec<Round> {
        (0..count)
            .map(|i| {
                // A different spread a row, so that rows are not copies of each other.
                let confidence: Vec<f32> = (0..edge.len())
                    .map(|k| {
                        ((i * (2 * k + 3) + k) % count) as f32 / count as f32 + 0.5 / count as f32
                    })
                    .collect();
                let accepted = confidence
                    .iter()
                    .zip(edge)
                    .take_while(|(c, e)| c >= e)
                    .count();
                Round {
                    confidence,
                    proposed: edge.len(),
                    accepted,
                }
            })
            .collect()
    }

    #[test]
    fn each_rows_threshold_lands_on_the_confidence_where_acceptance_starts() {
        let edge = [0.3, 0.6, 0.45];
        let rounds = rounds_with_edges(&edge, 400);
        let fit = fit_thresholds(&rounds, 0.5, 20).unwrap();
        for (k, &e) in edge.iter().enumerate() {
            // The lowest confidence at or above the edge among the rounds that reached row k.
            let lowest_accepted = rounds
                .iter()
                .filter(|r| r.accepted >= k)
                .map(|r| r.confidence[k])
                .filter(|&c| c >= e)
                .fold(f32::MAX, f32::min);
            let t = fit.thresholds[k];
            assert_eq!(t, lowest_accepted, "row {k}: acceptance starts at {e}");
            assert!(t - e < 0.02, "row {k}: threshold {t}");
            assert!(!fit.rows[k].inherited);
        }
        // The cut keeps every accepted draft and proposes fewer.
        let uncut = replay(&rounds, &[]);
        let cut = replay(&rounds, &fit.thresholds);
        assert_eq!(cut.accepted, uncut.accepted);
        assert!(cut.proposed < uncut.proposed, "{cut:?} against {uncut:?}");
    }

    #[test]
    fn noisy_outcomes_give_a_threshold_where_the_fitted_chance_crosses() {
        // Acceptance chance rises linearly with confidence: c. Outcomes drawn with a fixed
        // sequence, so the fit sees noise; its threshold for 0.5 should sit near 0.5.
        let mut state = 12345u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) as f64) / ((1u64 << 31) as f64)
        };
        let rounds: Vec<Round> = (0..4000)
            .map(|_| {
                let c = next() as f32;
                let accepted = usize::from(next() < f64::from(c));
                Round {
                    confidence: vec![c],
                    proposed: 1,
                    accepted,
                }
            })
            .collect();
        let fit = fit_thresholds(&rounds, 0.5, 20).unwrap();
        assert!(
            (fit.thresholds[0] - 0.5).abs() < 0.08,
            "{:?}",
            fit.thresholds
        );
        // Never-accepted rows are dropped whole; always-accepted rows are never cut.
        let never: Vec<Round> = (0..50)
            .map(|i| Round {
                confidence: vec![i as f32 / 50.0],
                proposed: 1,
                accepted: 0,
            })
            .collect();
        assert_eq!(
            fit_thresholds(&never, 0.1, 20).unwrap().thresholds,
            vec![DROP_ALL]
        );
        let always: Vec<Round> = never
            .iter()
            .map(|r| Round {
                accepted: 1,
                ..r.clone()
            })
            .collect();
        assert_eq!(
            fit_thresholds(&always, 0.9, 20).unwrap().thresholds,
            vec![0.0]
        );
    }

    #[test]
    fn rows_reached_too_rarely_inherit_and_too_few_rounds_are_refused() {
        // Row 1 is reached only when row 0 is accepted, which happens in 10 of 100 rounds.
        let rounds: Vec<Round> = (0..100)
            .map(|i| Round {
                confidence: vec![i as f32 / 100.0, 0.5],
                proposed: 2,
                accepted: usize::from(i >= 90),
            })
            .collect();
        let fit = fit_thresholds(&rounds, 0.5, 20).unwrap();
        assert!(
            (fit.thresholds[0] - 0.9).abs() < 1e-6,
            "{:?}",
            fit.thresholds
        );
        assert_eq!(fit.rows[1].samples, 10);
        assert!(fit.rows[1].inherited);
        assert_eq!(fit.thresholds[1], fit.thresholds[0]);
        let err = fit_thresholds(&rounds[..5], 0.5, 20).unwrap_err();
        assert!(err.to_string().contains("only 5"), "{err}");
        assert!(fit_thresholds(&rounds, 1.5, 20).is_err());
    }

    #[test]
    fn a_log_with_impossible_counts_is_refused_by_line() {
        let dir = std::env::temp_dir().join(format!("mlx-spec-calibrate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rounds.jsonl");
        std::fs::write(
            &path,
            "{\"confidence\": [0.9, 0.2], \"proposed\": 2, \"accepted\": 1}\n\n{\"confidence\": [0.9], \"proposed\": 2, \"accepted\": 1}\n",
        )
        .unwrap();
        let err = read_rounds(&path).unwrap_err().to_string();
        assert!(
            err.contains("line 3") && err.contains("block of 1 rows"),
            "{err}"
        );
        std::fs::write(
            &path,
            "{\"confidence\": [0.9, 0.2], \"proposed\": 2, \"accepted\": 1}\n",
        )
        .unwrap();
        assert_eq!(read_rounds(&path).unwrap().len(), 1);
        std::fs::write(&path, "not json\n").unwrap();
        assert!(read_rounds(&path)
            .unwrap_err()
            .to_string()
            .contains("line 1"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
