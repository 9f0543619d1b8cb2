//! The echo drafter of tests/drop-in, built against the revision-1 SDK: proposes the history's
//! last token again, at most `repeat` times.

use mlx_spec_plugin_api::{declare_drafter_plugin, Drafter, DrafterSession, Proposal, SamplingInfo, Target, TargetInfo};

pub struct Echo {
    repeat: usize,
}

impl Drafter for Echo {
    type Session = EchoSession;

    fn from_config(config: &mlx_spec_plugin_api::serde_json::Value) -> Result<Self, String> {
        let repeat = config.get("repeat").and_then(|v| v.as_u64()).ok_or("echo: `repeat` must be a positive integer")?;
        Ok(Echo { repeat: repeat as usize })
    }

    fn open(&self, _target: &TargetInfo, _sampling: &SamplingInfo) -> Result<EchoSession, String> {
        Ok(EchoSession { repeat: self.repeat })
    }
}

pub struct EchoSession {
    repeat: usize,
}

impl DrafterSession for EchoSession {
    fn draft(&mut self, history: &[u32], n: usize, _step: u64, _target: &Target<'_>) -> Result<Proposal, String> {
        let last = *history.last().ok_or("empty history")?;
        Ok(Proposal::tokens(vec![last; n.min(self.repeat)]))
    }
}

declare_drafter_plugin!("echo-r1", Echo);
