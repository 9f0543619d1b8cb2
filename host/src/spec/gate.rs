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

/// Below this many accepted tokens per drafted round, a round costs more than it returns.
pub const MIN_ACCEPTED_PER_ROUND: f64 = 0.25;
const DECAY: f64 = 0.7;
const FIRST_PAUSE: u32 = 16;
const MAX_PAUSE: u32 = 512;
/// Rounds observed before the first verdict.
const WARMUP_ROUNDS: u32 = 3;

#[derive(Debug, Clone)]
pub struct DraftGate {
    enabled: bool,
    accepted: f64,
    rounds: f64,
    observed: u32,
    paused_for: u32,
    next_pause: u32,
    /// Rounds decoded plainly because the gate was closed.
    pub paused_rounds: u64,
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
            paused_rounds: 0,
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
        if !self.enabled || self.observed < WARMUP_ROUNDS || self.rounds <= 0.0 {
            return k_max;
        }
        let recent = self.accepted / self.rounds;
        ((2.0 * recent).ceil() as usize + 1).clamp(1, k_max)
    }

    /// Records a verified round that drafted `drafted > 0` tokens and accepted `accepted`.
    pub fn observe(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.accepted = self.accepted * DECAY + accepted as f64;
        self.rounds = self.rounds * DECAY + 1.0;
        self.observed += 1;
        if !self.enabled || self.observed < WARMUP_ROUNDS {
            return;
        }
        if self.accepted / self.rounds < MIN_ACCEPTED_PER_ROUND {
            self.paused_for = self.next_pause;
            self.next_pause = (self.next_pause * 2).min(MAX_PAUSE);
            // The memory is kept: the probe after the pause drafts few tokens, and one good
            // probe lifts the decayed rate over the threshold again.
        } else if self.accepted / self.rounds >= 2.0 * MIN_ACCEPTED_PER_ROUND {
            // Comfortably useful again: forget the back-off.
            self.next_pause = FIRST_PAUSE;
        }
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
                asked.push(n);
                // One accepted token every third round.
                gate.observe(n, usize::from(i % 3 == 0));
            }
        }
        // After the warm-up rounds (full length), drafts stay short.
        let after_warmup = &asked[WARMUP_ROUNDS as usize..];
        assert!(!after_warmup.is_empty());
        assert!(
            after_warmup.iter().all(|&n| n <= 2),
            "draft lengths stay long: {asked:?}"
        );
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

    #[test]
    fn disabled_gate_never_pauses() {
        let mut gate = DraftGate::new(false);
        for _ in 0..100 {
            assert!(gate.should_draft());
            gate.observe(10, 0);
        }
    }
}
