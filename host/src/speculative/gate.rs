//! Auto-off: stop drafting while a drafter keeps being wrong, so speculation never costs
//! much more than plain decode.
//!
//! Acceptance is tracked as an exponentially decayed count of accepted tokens per drafted
//! round. Two controls follow from it:
//! * the draft length: a round asks for about twice the recent acceptance plus one token,
//!   so a drafter that is mostly wrong only costs a verify window of one or two extra tokens;
//! * pausing: when acceptance falls below [`MIN_ACCEPTED_PER_ROUND`], drafting pauses for a
//!   number of rounds (plain decode steps) that doubles after each failed probe, up to
//!   `MAX_PAUSE`; one probe round then tests the drafter again.
//!
//! A drafter that proposes nothing costs nothing and is not penalised.
//!
//! A third control follows what rounds cost where the loop times them
//! ([`DraftGate::observe_round_time`], [`DraftGate::observe_plain_time`]): a drafted round
//! that takes `c` times as long as a plain token pays only while it accepts more than `c - 1`
//! tokens on average. On a CPU a verify window costs about two plain tokens; on a GPU, where a
//! window of several tokens runs MLX's operations, it can cost four (BENCHMARKS.md). The
//! average here has a long memory ([`SLOW_DECAY`]): a drafter like prompt lookup accepts in
//! streaks, and judging it by its last few rounds pauses it through the next streak. Once
//! drafted rounds have been timed, the gate runs a few plain rounds to learn a plain token's
//! cost, unless the drafter accepts so much that no measured cost would make it lose.
//!
//! With [`DraftGate::with_fitted_length`] (the default; a deploy config's
//! `fitted_draft_length = false` turns it off), once rounds of two or more
//! lengths have been timed, the draft length follows from the costs instead: a line fitted to
//! a round's seconds against its window length, and the long-memory rate at which the draft at
//! each position is accepted given that the ones before it were, give each length's expected
//! tokens a second; the gate asks for the length with the most. Rates by position, not one
//! rate: prompt lookup accepts in streaks, so a draft deep in a round is right more often than
//! the first one. On an H200 a window of 8 costs about 3.7 plain tokens and one of 4 about 2.5,
//! so a drafter right 70 % of the time loses with 7 drafts and breaks even with 3
//! (BENCHMARKS.md).

/// Below this many accepted tokens per drafted round, a round costs more than it returns
/// (the threshold while the rounds' costs are unknown, and its floor).
pub const MIN_ACCEPTED_PER_ROUND: f64 = 0.25;
const DECAY: f64 = 0.7;
const FIRST_PAUSE: u32 = 16;
const MAX_PAUSE: u32 = 512;
/// Rounds observed before the first verdict.
const WARMUP_ROUNDS: u32 = 3;
/// Plain rounds run once, after the warm-up, to time a plain token when no plain round has
/// been timed yet.
pub const CALIBRATION_ROUNDS: u32 = 8;
/// A drafter accepting more than this many tokens a round pays for any round cost measured
/// (about four plain tokens at most, on the H200), so it is not interrupted to time plain
/// tokens.
const CALIBRATE_BELOW: f64 = 5.0;
/// Decay of the long-memory acceptance the rounds' cost is weighed against (about twenty
/// rounds).
const SLOW_DECAY: f64 = 0.95;
/// Decayed rounds that must have reached a draft position before its acceptance rate counts.
const MIN_REACHED: f64 = 1.0;
/// Drafted rounds observed before the rounds' cost can pause a drafter.
const COST_WARMUP_ROUNDS: u32 = 10;
/// The longest back-off a request starts with when it carries an earlier request's: a new
/// prompt may suit the drafter better, so it gets a probe every this many rounds at least
/// (or every [`DraftGate::probe_spacing`] rounds where probes cost more).
const MAX_CARRIED_PAUSE: u32 = 4 * FIRST_PAUSE;
/// The share of plain decoding's time that probing a paused drafter may cost: a probe that
/// fails costs its round's price over a plain token's (the break-even, in plain tokens), so a
/// pause lasts at least that over this share. On an H200 a round of the default model costs
/// about five plain tokens, and probes every 16-64 tokens cost 5-8 % (BENCHMARKS.md).
const PROBE_SHARE: f64 = 0.02;

/// What a gate learned about its drafter that outlives one request: the costs of drafted and
/// plain rounds on this machine, the long-memory acceptance by draft position, and the
/// back-off. A caller that runs many requests with one drafter (the bench, the server) hands
/// it from each finished request to the next ([`GateMemory::remember`],
/// [`DraftGate::resumed`]), so a request starts with the verdict instead of relearning it in
/// its first rounds; a request of a few dozen rounds spends most of them learning otherwise.
#[derive(Debug, Clone, Default)]
pub struct GateMemory(Option<DraftGate>);

impl GateMemory {
    /// Keeps what `gate` learned, if it saw a drafted round (a request whose drafter never
    /// drafted leaves the earlier memory as it was).
    pub fn remember(&mut self, gate: &DraftGate) {
        if gate.observed > 0 {
            self.0 = Some(gate.clone());
        }
    }

    /// Whether a drafted round has been remembered.
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }
}

#[derive(Debug, Clone)]
pub struct DraftGate {
    enabled: bool,
    accepted: f64,
    rounds: f64,
    observed: u32,
    paused_for: u32,
    next_pause: u32,
    /// Accepted tokens and drafted rounds with [`SLOW_DECAY`].
    slow_accepted: f64,
    slow_rounds: f64,
    /// By draft position, with [`SLOW_DECAY`]: rounds that reached the position (every draft
    /// before it accepted) and rounds that accepted it; their ratio estimates the chance that
    /// the draft there is right given that the ones before it were.
    reached: Vec<f64>,
    accepted_at: Vec<f64>,
    /// Decayed mean seconds of a drafted round (drafting and verifying), when timed.
    round_seconds: Option<f64>,
    /// A drafted round's seconds against its window length (drafts and the pending token).
    round_cost: CostLine,
    /// Decayed mean seconds of a plainly decoded token, when timed.
    plain_seconds: Option<f64>,
    /// Rounds decoded plainly because the gate was closed.
    pub paused_rounds: u64,
    /// Whether the next drafted round ends a pause: it asks for the full length, so that a
    /// drafter right in streaks can show that a round pays (a probe of a few drafts cannot
    /// accept more than the break-even of a dear round).
    probe_next: bool,
    /// Whether [`DraftGate::draft_len`] follows [`DraftGate::fastest_draft_len`].
    fitted_length: bool,
}

impl DraftGate {
    pub fn new(enabled: bool) -> Self {
        DraftGate {
            enabled,
            accepted: 0.0,
            rounds: 0.0,
            observed: 0,
            paused_for: 0,
            next_pause: FIRST_PAUSE,
            slow_accepted: 0.0,
            slow_rounds: 0.0,
            reached: Vec::new(),
            accepted_at: Vec::new(),
            round_seconds: None,
            round_cost: CostLine::default(),
            plain_seconds: None,
            paused_rounds: 0,
            probe_next: false,
            fitted_length: false,
        }
    }

    /// A gate for a new request that starts from what `memory` holds: the warm-ups done, the
    /// costs and acceptance rates known, and the back-off kept up to [`MAX_CARRIED_PAUSE`] or
    /// the probe spacing, whichever is longer. Acceptance depends on the prompt, so a new
    /// request's first round drafts, unless probes are so dear that one a request would cost
    /// more than their share ([`DraftGate::probe_spacing`] longer than [`MAX_CARRIED_PAUSE`]):
    /// then the pause that was running carries on. With an empty memory, [`DraftGate::new`].
    pub fn resumed(enabled: bool, memory: &GateMemory) -> Self {
        let Some(learned) = &memory.0 else {
            return DraftGate::new(enabled);
        };
        let spacing = learned.probe_spacing();
        let cap = MAX_CARRIED_PAUSE.max(spacing);
        let dear_probes = spacing > MAX_CARRIED_PAUSE;
        DraftGate {
            enabled,
            paused_for: if dear_probes {
                learned.paused_for.min(cap)
            } else {
                0
            },
            paused_rounds: 0,
            next_pause: learned.next_pause.min(cap),
            ..learned.clone()
        }
    }

    /// The fewest plain rounds between two probes of a paused drafter, so that failed probes
    /// cost at most [`PROBE_SHARE`] of the plain rounds' time: the break-even over the share,
    /// once the rounds' costs are known (at most [`MAX_PAUSE`]).
    pub fn probe_spacing(&self) -> u32 {
        match self.break_even() {
            Some(b) if b > 0.0 => ((b / PROBE_SHARE).ceil() as u32).min(MAX_PAUSE),
            _ => 0,
        }
    }

    /// Starts this gate, its switches kept, from what `memory` holds ([`DraftGate::resumed`]).
    pub fn resume(&mut self, memory: &GateMemory) {
        let fitted_length = self.fitted_length;
        *self = DraftGate::resumed(self.enabled, memory).with_fitted_length(fitted_length);
    }

    /// This gate, sizing rounds by [`DraftGate::fastest_draft_len`] when `on` (off by default:
    /// it waits for a GPU measurement, BENCHMARKS.md).
    pub fn with_fitted_length(mut self, on: bool) -> Self {
        self.fitted_length = on;
        self
    }

    /// Records how long a drafted round of `drafted` tokens took, drafting and verifying
    /// (before its [`DraftGate::observe`]).
    pub fn observe_round_time(&mut self, seconds: f64, drafted: usize) {
        self.round_seconds = Some(decayed(self.round_seconds, seconds));
        self.round_cost.add(drafted as f64 + 1.0, seconds);
    }

    /// Records `tokens > 0` tokens decoded plainly in `seconds`.
    pub fn observe_plain_time(&mut self, seconds: f64, tokens: usize) {
        if tokens > 0 {
            self.plain_seconds = Some(decayed(self.plain_seconds, seconds / tokens as f64));
        }
    }

    /// Accepted tokens a drafted round needs on average to pay for its measured cost in
    /// plain tokens, when both kinds of round have been timed.
    pub fn break_even(&self) -> Option<f64> {
        match (self.round_seconds, self.plain_seconds) {
            (Some(round), Some(plain)) if plain > 0.0 => Some(round / plain - 1.0),
            _ => None,
        }
    }

    /// Whether to ask the drafter this round (counts a paused round when not).
    pub fn should_draft(&mut self) -> bool {
        if self.paused_for > 0 {
            self.paused_for -= 1;
            self.paused_rounds += 1;
            return false;
        }
        true
    }

    /// Rounds that will not draft, from now: the rest of the current pause.
    pub fn paused_remaining(&self) -> u32 {
        self.paused_for
    }

    /// Spends up to `rounds` rounds of the current pause at once (counted as paused rounds),
    /// as [`DraftGate::should_draft`] would one by one.
    pub fn spend_pause(&mut self, rounds: usize) {
        let spent = self.paused_for.min(rounds as u32);
        self.paused_for -= spent;
        self.paused_rounds += spent as u64;
    }

    /// How many tokens to ask for this round, at most `k_max`.
    pub fn draft_len(&self, k_max: usize) -> usize {
        if !self.enabled || self.observed < WARMUP_ROUNDS || self.rounds <= 0.0 || self.probe_next {
            return k_max;
        }
        if let Some(best) = self
            .fitted_length
            .then(|| self.fastest_draft_len(k_max))
            .flatten()
        {
            return best;
        }
        let recent = self.accepted / self.rounds;
        ((2.0 * recent).ceil() as usize + 1).clamp(1, k_max)
    }

    /// The draft length, at most `k_max`, whose rounds emit the most tokens a second, from the
    /// fitted round cost and the long-memory acceptance rates by position; `None` until rounds
    /// of two lengths have been timed. A round of `n` drafts, the one at position `j` right with
    /// chance `a_j` given the ones before, emits `1 + a_0 + a_0 a_1 + … + a_0 … a_(n-1)` tokens
    /// on average. A position rarely reached takes the rate of the deepest one that is.
    pub fn fastest_draft_len(&self, k_max: usize) -> Option<usize> {
        let (fixed, per_token) = self.round_cost.line()?;
        if self.reached.first().is_none_or(|&r| r < MIN_REACHED) {
            return None;
        }
        let (mut expected, mut power, mut rate) = (1.0, 1.0, 0.0);
        let mut rates = Vec::with_capacity(k_max.max(1));
        for n in 1..=k_max.max(1) {
            let j = n - 1;
            if self.reached.get(j).is_some_and(|&r| r >= MIN_REACHED) {
                rate = (self.accepted_at[j] / self.reached[j]).clamp(0.0, 0.999);
            }
            power *= rate;
            expected += power;
            let seconds = (fixed + per_token * (n as f64 + 1.0)).max(1e-12);
            rates.push(expected / seconds);
        }
        // The shortest length within 1 % of the fastest: the line is an estimate, and a
        // shorter round wastes less when a draft is rejected.
        let fastest = rates.iter().copied().fold(f64::MIN, f64::max);
        rates
            .iter()
            .position(|&r| r >= 0.99 * fastest)
            .map(|i| i + 1)
    }

    /// Records a verified round that drafted `drafted > 0` tokens and accepted `accepted`.
    pub fn observe(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.accepted = self.accepted * DECAY + accepted as f64;
        self.rounds = self.rounds * DECAY + 1.0;
        self.slow_accepted = self.slow_accepted * SLOW_DECAY + accepted as f64;
        self.slow_rounds = self.slow_rounds * SLOW_DECAY + 1.0;
        if self.reached.len() < drafted {
            self.reached.resize(drafted, 0.0);
            self.accepted_at.resize(drafted, 0.0);
        }
        for j in 0..self.reached.len() {
            self.reached[j] *= SLOW_DECAY;
            self.accepted_at[j] *= SLOW_DECAY;
            if j < drafted && j <= accepted {
                self.reached[j] += 1.0;
                if j < accepted {
                    self.accepted_at[j] += 1.0;
                }
            }
        }
        self.observed += 1;
        self.probe_next = false;
        if !self.enabled || self.observed < WARMUP_ROUNDS {
            return;
        }
        let threshold = MIN_ACCEPTED_PER_ROUND;
        let costs_more = self.observed >= COST_WARMUP_ROUNDS
            && self
                .break_even()
                .is_some_and(|b| self.slow_accepted / self.slow_rounds < b);
        if self.accepted / self.rounds < threshold || costs_more {
            self.paused_for = self.next_pause.max(self.probe_spacing());
            self.probe_next = true;
            self.next_pause = (self.next_pause * 2).min(MAX_PAUSE);
            // The memory is kept: the probe after the pause drafts few tokens, and one good
            // probe lifts the decayed rate over the threshold again.
        } else {
            if self.accepted / self.rounds >= 2.0 * threshold {
                // Comfortably useful again: forget the back-off.
                self.next_pause = FIRST_PAUSE;
            }
            if self.round_seconds.is_some()
                && self.plain_seconds.is_none()
                && self.slow_accepted / self.slow_rounds < CALIBRATE_BELOW
            {
                // Drafted rounds are timed, plain ones not yet: a few plain rounds tell
                // what drafting has to beat (they time a plain token, so this runs once).
                self.paused_for = CALIBRATION_ROUNDS;
            }
        }
    }
}

/// A line `seconds = fixed + per_token * window` fitted by least squares to decayed samples
/// ([`SLOW_DECAY`]): a verify window's cost grows about linearly with its length on every
/// device measured.
#[derive(Debug, Clone, Default)]
struct CostLine {
    weight: f64,
    w: f64,
    ww: f64,
    y: f64,
    wy: f64,
}

impl CostLine {
    fn add(&mut self, window: f64, seconds: f64) {
        let d = SLOW_DECAY;
        self.weight = self.weight * d + 1.0;
        self.w = self.w * d + window;
        self.ww = self.ww * d + window * window;
        self.y = self.y * d + seconds;
        self.wy = self.wy * d + window * seconds;
    }

    /// `(fixed, per_token)`, once the samples span lengths enough to tell them apart (their
    /// weighted spread of lengths at least a quarter of a token squared). A per-token cost
    /// that comes out negative (noise) is taken as zero: every length then costs the mean.
    fn line(&self) -> Option<(f64, f64)> {
        if self.weight <= 0.0 {
            return None;
        }
        let mean_w = self.w / self.weight;
        let spread = self.ww / self.weight - mean_w * mean_w;
        if spread < 0.25 {
            return None;
        }
        let per_token = (self.wy / self.weight - mean_w * self.y / self.weight) / spread;
        if per_token < 0.0 {
            return Some((self.y / self.weight, 0.0));
        }
        Some((self.y / self.weight - per_token * mean_w, per_token))
    }
}

/// `previous` decayed by [`DECAY`] towards `sample` (the sample itself when there is none).
fn decayed(previous: Option<f64>, sample: f64) -> f64 {
    match previous {
        Some(p) => p * DECAY + sample * (1.0 - DECAY),
        None => sample,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drafter_that_is_always_wrong_is_probed_ever_more_rarely() {
        let mut gate = DraftGate::new(true);
        let mut drafted_rounds = 0;
        for _ in 0..2000 {
            if gate.should_draft() {
                drafted_rounds += 1;
                gate.observe(10, 0);
            }
        }
        // 3 warm-up rounds, then one probe after pauses of 16, 32, … 512, 512, …
        assert!(
            drafted_rounds < 20,
            "{drafted_rounds} drafted rounds out of 2000"
        );
        assert!(gate.paused_rounds > 1900);
    }

    #[test]
    fn a_good_drafter_is_never_paused_and_keeps_long_drafts() {
        let mut gate = DraftGate::new(true);
        for i in 0..500 {
            assert!(gate.should_draft(), "paused at round {i}");
            let n = gate.draft_len(10);
            gate.observe(n, (n * 3 / 4).max(1));
        }
        assert_eq!(gate.draft_len(10), 10);
    }

    #[test]
    fn a_rarely_right_drafter_gets_short_drafts() {
        let mut gate = DraftGate::new(true);
        let mut asked = Vec::new();
        for i in 0..200 {
            if gate.should_draft() {
                let n = gate.draft_len(10);
                asked.push((n, gate.probe_next));
                // One accepted token every third round.
                gate.observe(n, usize::from(i % 3 == 0));
            }
        }
        // After the warm-up rounds (full length), drafts stay short but for the probes that
        // end a pause.
        let after_warmup = &asked[WARMUP_ROUNDS as usize..];
        assert!(after_warmup.iter().any(|&(_, probe)| !probe));
        assert!(
            after_warmup
                .iter()
                .all(|&(n, probe)| if probe { n == 10 } else { n <= 2 }),
            "draft lengths: {asked:?}"
        );
    }

    #[test]
    fn the_probe_after_a_pause_asks_for_the_full_length() {
        let mut gate = DraftGate::new(true);
        for _ in 0..WARMUP_ROUNDS {
            assert_eq!(gate.draft_len(10), 10);
            gate.observe(10, 0);
        }
        assert!(gate.paused_remaining() > 0);
        gate.spend_pause(gate.paused_remaining() as usize);
        assert!(gate.should_draft());
        assert_eq!(gate.draft_len(10), 10, "the probe");
        // A probe that finds a streak: drafting goes on at the recent acceptance's length.
        gate.observe(10, 9);
        assert_eq!(gate.paused_remaining(), 0);
        assert!(gate.draft_len(10) < 10);
    }

    #[test]
    fn spending_a_pause_at_once_counts_as_round_by_round() {
        let (mut one_by_one, mut at_once) = (DraftGate::new(true), DraftGate::new(true));
        for gate in [&mut one_by_one, &mut at_once] {
            for _ in 0..WARMUP_ROUNDS {
                gate.observe(10, 0);
            }
        }
        let pause = one_by_one.paused_remaining();
        assert_eq!(pause, FIRST_PAUSE);
        for _ in 0..5 {
            assert!(!one_by_one.should_draft());
        }
        at_once.spend_pause(5);
        assert_eq!(at_once.paused_remaining(), one_by_one.paused_remaining());
        assert_eq!(at_once.paused_rounds, one_by_one.paused_rounds);
        // Never more than the pause holds.
        at_once.spend_pause(1000);
        assert_eq!(at_once.paused_remaining(), 0);
        assert_eq!(at_once.paused_rounds, u64::from(pause));
        assert!(at_once.should_draft());
    }

    /// Rounds of a drafter that accepts `accepted` of 10 drafted tokens every round, each
    /// drafted round taking `cost` plain tokens' time; returns the drafted rounds out of 300.
    fn drafted_rounds_at(cost: f64, accepted: usize) -> (u32, DraftGate) {
        let mut gate = DraftGate::new(true);
        let drafted = run_rounds(&mut gate, 300, cost, accepted);
        (drafted, gate)
    }

    /// Runs `rounds` rounds through `gate`: a drafted round of 10 drafts takes `cost` plain
    /// tokens' time and accepts `accepted`, a plain one a plain token's. Returns the drafted.
    fn run_rounds(gate: &mut DraftGate, rounds: u32, cost: f64, accepted: usize) -> u32 {
        let mut drafted = 0;
        for _ in 0..rounds {
            if gate.should_draft() {
                drafted += 1;
                gate.observe_round_time(cost * 1e-3, 10);
                gate.observe(10, accepted);
            } else {
                gate.observe_plain_time(1e-3, 1);
            }
        }
        drafted
    }

    #[test]
    fn a_costly_verify_round_pauses_a_drafter_that_would_pay_on_a_cheap_one() {
        // Two accepted tokens a round: three tokens for the price of four on a GPU-like
        // device, for the price of 1.5 on a CPU-like one.
        let (costly, gate) = drafted_rounds_at(4.0, 2);
        assert!((gate.break_even().unwrap() - 3.0).abs() < 1e-9);
        assert!(
            costly < 40,
            "{costly} drafted rounds of 300 at 4 plain tokens a round"
        );
        let (cheap, gate) = drafted_rounds_at(1.5, 2);
        assert!((gate.break_even().unwrap() - 0.5).abs() < 1e-9);
        // The warm-up, then the calibration's plain rounds once, then drafting throughout.
        assert_eq!(
            cheap,
            300 - CALIBRATION_ROUNDS,
            "{cheap} drafted rounds of 300"
        );
    }

    /// Requests of `rounds` rounds each of a drafter that accepts `accepted` of 10 drafts,
    /// a drafted round costing `cost` plain tokens; the drafted rounds of each request, its
    /// gate started from the previous requests' memory when `carry` is set.
    fn drafted_rounds_per_request(
        cost: f64,
        accepted: usize,
        rounds: u32,
        carry: bool,
    ) -> Vec<u32> {
        let mut memory = GateMemory::default();
        (0..8)
            .map(|_| {
                let mut gate = DraftGate::resumed(true, &memory);
                let drafted = run_rounds(&mut gate, rounds, cost, accepted);
                if carry {
                    memory.remember(&gate);
                }
                drafted
            })
            .collect()
    }

    #[test]
    fn a_losing_drafter_is_judged_once_not_in_every_request() {
        // One accepted token a round at the price of three plain tokens: a loss. Alone, each
        // request of 40 rounds drafts through the warm-ups before the cost can pause it.
        let alone = drafted_rounds_per_request(3.0, 1, 40, false);
        assert!(alone.iter().all(|&d| d >= COST_WARMUP_ROUNDS), "{alone:?}");
        // Carried, the requests after the first probe once, then at most once per pause.
        let carried = drafted_rounds_per_request(3.0, 1, 40, true);
        assert_eq!(
            carried[0], alone[0],
            "the first request has nothing to start from"
        );
        assert!(
            carried[1..].iter().all(|&d| d <= 3),
            "drafted rounds per request: {carried:?}"
        );
        assert!(carried[1..].iter().any(|&d| d > 0), "never probed again");
    }

    /// Plain-token times per emitted token over requests of `tokens` tokens each, one memory
    /// carried across them, for a drafter accepting `accepted` of 10 drafts in rounds costing
    /// `cost` plain tokens: 1.0 is plain decoding's pace.
    fn relative_time(cost: f64, accepted: usize, tokens: u32, requests: u32) -> f64 {
        let mut memory = GateMemory::default();
        let (mut time, mut emitted) = (0.0, 0u32);
        for _ in 0..requests {
            let mut gate = DraftGate::resumed(true, &memory);
            let mut left = tokens;
            while left > 0 {
                if gate.should_draft() {
                    gate.observe_round_time(cost * 1e-3, 10);
                    gate.observe(10, accepted);
                    time += cost;
                    left = left.saturating_sub(1 + accepted as u32);
                } else {
                    gate.observe_plain_time(1e-3, 1);
                    time += 1.0;
                    left -= 1;
                }
            }
            emitted += tokens;
            memory.remember(&gate);
        }
        time / emitted as f64
    }

    #[test]
    fn probing_a_losing_drafter_costs_little_where_rounds_are_dear() {
        // A GPU-like round of five plain tokens' time accepting one token: each probe loses
        // three plain tokens. Over twenty requests of 128 tokens (the bench's free-text set)
        // the warm-up of the first request and the probes stay within the 3 % auto-off allows.
        let slowdown = relative_time(5.0, 1, 128, 20);
        assert!(slowdown < 1.03, "{slowdown:.3} of plain decoding's time");
        // The spacing follows the break-even: four plain tokens over 2 %.
        let mut gate = DraftGate::new(true);
        run_rounds(&mut gate, 40, 5.0, 1);
        assert_eq!(gate.probe_spacing(), 200);
        // A CPU-like round of two plain tokens: probes every 50 tokens at least.
        let mut gate = DraftGate::new(true);
        run_rounds(&mut gate, 40, 2.0, 0);
        assert_eq!(gate.probe_spacing(), 50);
        // Untimed rounds set no spacing.
        assert_eq!(DraftGate::new(true).probe_spacing(), 0);
    }

    #[test]
    fn a_paying_drafter_keeps_drafting_from_a_requests_first_round() {
        // Four accepted tokens at the price of two plain tokens: the later requests draft every
        // round, with no warm-up and no calibration pause.
        let carried = drafted_rounds_per_request(2.0, 4, 40, true);
        assert!(carried[0] < 40, "the first request times plain rounds once");
        assert!(carried[1..].iter().all(|&d| d == 40), "{carried:?}");
    }

    #[test]
    fn a_resumed_gate_probes_first_unless_probes_are_dear() {
        let mut gate = DraftGate::new(true);
        // Always wrong: the back-off grows to its longest.
        for _ in 0..5000 {
            if gate.should_draft() {
                gate.observe(10, 0);
            }
        }
        assert_eq!(gate.next_pause, MAX_PAUSE);
        // Mid-pause when the request ends.
        gate.spend_pause(10);
        assert!(gate.paused_remaining() > MAX_CARRIED_PAUSE);
        let mut memory = GateMemory::default();
        assert!(memory.is_empty());
        memory.remember(&gate);
        let mut next = DraftGate::resumed(true, &memory);
        assert_eq!(next.paused_rounds, 0);
        // Untimed rounds (probes cost nothing known): a new prompt gets a probe first, and the
        // back-off is cut to the carried cap.
        assert!(next.should_draft(), "a new prompt gets a probe first");
        next.observe(10, 0);
        assert_eq!(next.paused_remaining(), MAX_CARRIED_PAUSE);
        // Dear rounds (five plain tokens: a probe every 200 tokens at most): the running pause
        // carries on into the next request instead.
        let mut dear = DraftGate::new(true);
        run_rounds(&mut dear, 300, 5.0, 1);
        assert!(dear.probe_spacing() > MAX_CARRIED_PAUSE);
        assert!(dear.paused_remaining() > 0);
        let mut dear_memory = GateMemory::default();
        dear_memory.remember(&dear);
        let resumed = DraftGate::resumed(true, &dear_memory);
        assert_eq!(resumed.paused_remaining(), dear.paused_remaining());
        // A request that never drafted leaves the memory as it was.
        memory.remember(&DraftGate::new(true));
        assert_eq!(DraftGate::resumed(true, &memory).observed, gate.observed);
        // An empty memory is a new gate.
        let fresh = DraftGate::resumed(true, &GateMemory::default());
        assert_eq!(fresh.observed, 0);
        assert_eq!(fresh.next_pause, FIRST_PAUSE);
    }

    #[test]
    fn plain_rounds_are_timed_once_when_no_plain_round_has_been() {
        let mut gate = DraftGate::new(true);
        for _ in 0..WARMUP_ROUNDS {
            assert!(gate.should_draft());
            gate.observe_round_time(2e-3, 10);
            gate.observe(10, 4);
        }
        assert_eq!(gate.paused_remaining(), CALIBRATION_ROUNDS);
        gate.spend_pause(CALIBRATION_ROUNDS as usize);
        gate.observe_plain_time(8e-3, 8);
        for _ in 0..50 {
            assert!(gate.should_draft());
            gate.observe_round_time(2e-3, 10);
            gate.observe(10, 4);
        }
        // A drafter that accepts nearly everything is never interrupted to time plain rounds.
        let mut oracle = DraftGate::new(true);
        for _ in 0..50 {
            assert!(oracle.should_draft());
            oracle.observe_round_time(2e-3, 10);
            oracle.observe(10, 10);
        }
        // Without timings the threshold is the fixed one, and no calibration is asked for.
        let mut untimed = DraftGate::new(true);
        for _ in 0..10 {
            untimed.observe(10, 1);
        }
        assert_eq!(untimed.paused_remaining(), 0);
        assert_eq!(untimed.break_even(), None);
    }

    #[test]
    fn a_streaky_drafter_that_pays_on_average_is_not_paused_by_its_cost() {
        // Two rounds of nine accepted tokens, then three misses, over and over: 3.6 a round
        // on average against a break-even of 1, although its last rounds are often misses.
        let mut gate = DraftGate::new(true);
        gate.observe_plain_time(1e-3, 1);
        let mut paused = 0;
        for i in 0..400 {
            if gate.should_draft() {
                gate.observe_round_time(2e-3, 10);
                gate.observe(10, if i % 5 < 2 { 9 } else { 0 });
            } else {
                paused += 1;
            }
        }
        assert_eq!(paused, 0, "paused {paused} rounds of 400");
    }

    /// A gate that has timed rounds of 7 and 9 drafts on a device where a window of `w` tokens
    /// costs `fixed + per_token * w` milliseconds, then learnt that a draft at any position is
    /// right 80 % of the time given the ones before it.
    fn gate_after_two_lengths(fixed: f64, per_token: f64) -> DraftGate {
        let mut gate = DraftGate::new(true);
        gate.observe_plain_time(4.3e-3, 1);
        for i in 0..20 {
            let drafted = if i % 2 == 0 { 7 } else { 9 };
            gate.observe_round_time((fixed + per_token * (drafted + 1) as f64) * 1e-3, drafted);
            gate.observe(drafted, 4);
        }
        gate.reached = vec![100.0; 9];
        gate.accepted_at = vec![80.0; 9];
        gate
    }

    #[test]
    fn acceptance_is_counted_by_draft_position() {
        let mut gate = DraftGate::new(true);
        // Five drafts, two accepted: positions 0-2 reached (the third rejected), 0-1 accepted.
        gate.observe(5, 2);
        assert_eq!(gate.reached, [1.0, 1.0, 1.0, 0.0, 0.0]);
        assert_eq!(gate.accepted_at, [1.0, 1.0, 0.0, 0.0, 0.0]);
        // Then three of three: the earlier counts decay, positions 0-2 reached and accepted.
        gate.observe(3, 3);
        let d = SLOW_DECAY;
        assert_eq!(gate.reached, [d + 1.0, d + 1.0, d + 1.0, 0.0, 0.0]);
        assert_eq!(gate.accepted_at, [d + 1.0, d + 1.0, 1.0, 0.0, 0.0]);
    }

    #[test]
    fn a_streaky_drafter_keeps_long_drafts() {
        // Prompt lookup: the first draft is right half the time, but once one is, the rest
        // nearly always are. On H200-like costs the long drafts pay, where one rate of 0.5 for
        // every position would keep to one draft.
        let mut gate = gate_after_two_lengths(5.5, 1.3);
        gate.accepted_at = vec![50.0, 99.0, 99.0, 99.0, 99.0, 99.0, 99.0, 99.0, 99.0];
        assert_eq!(gate.fastest_draft_len(9), Some(9));
        gate.accepted_at = vec![50.0; 9];
        assert_eq!(gate.fastest_draft_len(9), Some(1));
    }

    #[test]
    fn the_draft_length_is_the_fastest_for_the_measured_costs() {
        // H200-like windows (5.5 ms + 1.3 ms a token: 8.1 ms for 2 tokens, 15.9 for 8) and
        // drafts right 80 % of the time: 4 drafts emit the most tokens a second.
        let gpu = gate_after_two_lengths(5.5, 1.3);
        assert_eq!(gpu.fastest_draft_len(10), Some(4));
        assert_eq!(
            gpu.draft_len(10),
            9,
            "recent acceptance decides unless asked otherwise"
        );
        let gpu = gpu.with_fitted_length(true);
        assert_eq!(gpu.draft_len(10), 4);
        assert_eq!(gpu.draft_len(3), 3, "never more than asked for");
        // Where a window's length costs little (a CPU-like 10 ms + 0.5 ms a token), the
        // longest.
        let cpu = gate_after_two_lengths(10.0, 0.5);
        assert_eq!(cpu.fastest_draft_len(7), Some(7));
    }

    #[test]
    fn the_draft_length_waits_for_rounds_of_two_lengths() {
        // Every round of the same length: the cost line cannot be told, the recent acceptance
        // decides as before (2 x 4 + 1 = 9 drafts).
        let mut gate = DraftGate::new(true);
        gate.observe_plain_time(4.3e-3, 1);
        for _ in 0..20 {
            gate.observe_round_time(15.9e-3, 10);
            gate.observe(10, 4);
        }
        assert_eq!(gate.fastest_draft_len(10), None);
        assert_eq!(gate.with_fitted_length(true).draft_len(10), 9);
    }

    #[test]
    fn disabled_gate_never_pauses() {
        let mut gate = DraftGate::new(false);
        for _ in 0..100 {
            assert!(gate.should_draft());
            gate.observe(10, 0);
        }
    }
}
