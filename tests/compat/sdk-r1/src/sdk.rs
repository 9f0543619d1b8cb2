//! The plain-Rust side of a drafter: implement [`Drafter`] and [`DrafterSession`] over
//! `&[u32]`, `mlx_rs::Array` and `Result<_, String>`, then export them with
//! [`crate::declare_drafter_plugin!`]. The adapters here translate to the stable ABI and catch
//! every panic, so a plugin author never writes FFI code or `catch_unwind`.

use std::panic::{catch_unwind, AssertUnwindSafe};

use abi_stable::sabi_trait::TD_Opaque;
use abi_stable::std_types::{RErr, ROk, ROption, RResult, RSlice, RString, RVec};
use mlx_rs::Array;

use crate::abi::{
    self, DraftProviderBox, DraftProvider_TO, DraftSourceBox, DraftSource_TO, PrefillMode,
    SamplingInfo, TargetInfo, TargetPortRef,
};
use crate::tensor::{Tensor, TensorRef};

/// A loaded drafter: built once from its configuration, opens one session per request.
pub trait Drafter: Send + Sync + Sized + 'static {
    type Session: DrafterSession;

    /// Builds the drafter from its configuration (manifest `[defaults]` merged with the run's
    /// overrides). Reject unknown or ill-typed keys with a message naming them.
    fn from_config(config: &serde_json::Value) -> Result<Self, String>;

    /// Resident bytes of the drafter's weights.
    fn weights_bytes(&self) -> u64 {
        0
    }

    /// Starts a request. Refuse targets the drafter cannot serve (wrong family, vocabulary…).
    fn open(&self, target: &TargetInfo, sampling: &SamplingInfo) -> Result<Self::Session, String>;
}

/// One proposal.
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// The distributions the tokens were drawn from, float32 `[tokens.len(), vocab]`.
    pub probs: Option<Array>,
}

impl Proposal {
    /// Proposes tokens without distributions (verified by exact match).
    pub fn tokens(tokens: Vec<u32>) -> Self {
        Proposal {
            tokens,
            probs: None,
        }
    }
}

/// Per-request drafter state.
pub trait DrafterSession: Send + 'static {
    /// Kept for compatibility: the host prefills the whole prompt for every source
    /// ([`PrefillMode`]), so the first `draft` call's history already ends with the first
    /// generated token.
    fn prefill_mode(&self) -> PrefillMode {
        PrefillMode::Full
    }

    fn prefill(&mut self, _prompt: &[u32], _target: &Target<'_>) -> Result<(), String> {
        Ok(())
    }

    /// Up to `n` tokens to follow `history`; `step_base` is the emitted index of the first.
    fn draft(
        &mut self,
        history: &[u32],
        n: usize,
        step_base: u64,
        target: &Target<'_>,
    ) -> Result<Proposal, String>;

    fn commit(
        &mut self,
        _drafted: usize,
        _accepted: usize,
        _emitted: &[u32],
    ) -> Result<(), String> {
        Ok(())
    }
}

/// The target's capabilities during one call.
pub struct Target<'a> {
    port: TargetPortRef<'a>,
}

impl Target<'_> {
    /// Tokens the target has processed.
    pub fn position(&self) -> u64 {
        self.port.position()
    }

    /// Scaled embeddings `[1, len, hidden]` of `ids`.
    pub fn embed(&self, ids: &[u32]) -> Result<Array, String> {
        into_result(self.port.embed(RSlice::from_slice(ids))).map(Tensor::into_array)
    }

    /// Float32 logits `[rows, vocab]` from final-norm hidden states.
    pub fn logits_from_hidden(&self, hidden: &Array) -> Result<Array, String> {
        into_result(self.port.logits_from_hidden(TensorRef::from_array(hidden)))
            .map(Tensor::into_array)
    }
}

fn into_result<T>(r: RResult<T, RString>) -> Result<T, String> {
    match r {
        ROk(v) => Ok(v),
        RErr(e) => Err(e.into_string()),
    }
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-text payload".to_owned())
}

/// Runs `f`, turning both its error and any panic into an error value for the host.
pub fn guarded<T>(f: impl FnOnce() -> Result<T, String>) -> RResult<T, RString> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => ROk(v),
        Ok(Err(e)) => RErr(RString::from(e)),
        Err(p) => RErr(RString::from(format!(
            "plugin panicked: {}",
            panic_text(&*p)
        ))),
    }
}

struct ProviderAdapter<D>(D);
struct SessionAdapter<S>(S);

impl<D: Drafter> abi::DraftProvider for ProviderAdapter<D> {
    fn weights_bytes(&self) -> u64 {
        catch_unwind(AssertUnwindSafe(|| self.0.weights_bytes())).unwrap_or(0)
    }

    fn open(&self, target: TargetInfo, sampling: SamplingInfo) -> RResult<DraftSourceBox, RString> {
        guarded(|| {
            let session = self.0.open(&target, &sampling)?;
            Ok(DraftSource_TO::from_value(
                SessionAdapter(session),
                TD_Opaque,
            ))
        })
    }
}

impl<S: DrafterSession> abi::DraftSource for SessionAdapter<S> {
    fn prefill_mode(&self) -> PrefillMode {
        catch_unwind(AssertUnwindSafe(|| self.0.prefill_mode())).unwrap_or(PrefillMode::Full)
    }

    fn prefill(
        &mut self,
        prompt: RSlice<'_, u32>,
        target: TargetPortRef<'_>,
    ) -> RResult<(), RString> {
        guarded(|| self.0.prefill(prompt.as_slice(), &Target { port: target }))
    }

    fn draft(
        &mut self,
        history: RSlice<'_, u32>,
        n: u32,
        step_base: u64,
        target: TargetPortRef<'_>,
    ) -> RResult<abi::Draft, RString> {
        guarded(|| {
            let p = self.0.draft(
                history.as_slice(),
                n as usize,
                step_base,
                &Target { port: target },
            )?;
            Ok(abi::Draft {
                tokens: RVec::from(p.tokens),
                probs: match p.probs {
                    Some(a) => ROption::RSome(Tensor::from_array(a)),
                    None => ROption::RNone,
                },
            })
        })
    }

    fn commit(
        &mut self,
        drafted: u32,
        accepted: u32,
        emitted: RSlice<'_, u32>,
    ) -> RResult<(), RString> {
        guarded(|| {
            self.0
                .commit(drafted as usize, accepted as usize, emitted.as_slice())
        })
    }
}

/// Builds a provider from JSON configuration; what `declare_drafter_plugin!` exports.
pub fn new_provider<D: Drafter>(config_json: &str) -> RResult<DraftProviderBox, RString> {
    guarded(|| {
        // Install mlx-rs's error handler into this library's own mlx-c copy before anything
        // else: until the first checked op, mlx-c's default handler would exit the process.
        Array::from_int(0)
            .eval()
            .map_err(|e| format!("MLX is not usable in the plugin: {e}"))?;
        let config: serde_json::Value = serde_json::from_str(config_json)
            .map_err(|e| format!("plugin configuration is not valid JSON: {e}"))?;
        let drafter = D::from_config(&config)?;
        Ok(DraftProvider_TO::from_value(
            ProviderAdapter(drafter),
            TD_Opaque,
        ))
    })
}

/// Wraps a drafter as an ABI provider without a library (tests, in-process drafters).
pub fn provider_in_process<D: Drafter>(drafter: D) -> DraftProviderBox {
    DraftProvider_TO::from_value(ProviderAdapter(drafter), TD_Opaque)
}

/// The value plugins give `mach_approximate_time` (see [`crate::declare_drafter_plugin!`]).
#[doc(hidden)]
pub fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
