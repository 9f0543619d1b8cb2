//! The plain-Rust side of a drafter: implement [`Drafter`] and [`DrafterSession`] over
//! `&[u32]`, `mlx_rs::Array` and `Result<_, String>`, then export them with
//! [`crate::declare_drafter_plugin!`]. The adapters here translate to the stable ABI and catch
//! every panic, so a plugin author never writes FFI code or `catch_unwind`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use abi_stable::sabi_trait::TD_Opaque;
use abi_stable::std_types::{RErr, ROk, ROption, RResult, RSlice, RString, RVec};
use mlx_rs::Array;

use crate::abi::{
    self, DraftProviderBox, DraftProvider_TO, DraftSourceBox, DraftSource_TO, PrefillMode,
    SamplingInfo, TapRows, TargetInfo, TargetPortRef,
};
use crate::target_spec::TargetSpec;
use crate::tensor::{Tensor, TensorRef};

/// A loaded drafter: built once from its configuration, opens one session per request.
///
/// Implement one of `from_config` / `from_config_in` (the latter when the configuration names
/// files, such as a checkpoint, relative to the plugin's folder) and one of `open` /
/// `open_for` (the latter to check the pairing against the target's description).
pub trait Drafter: Send + Sync + Sized + 'static {
    type Session: DrafterSession;

    /// Builds the drafter from its configuration (manifest `[defaults]` merged with the run's
    /// overrides). Reject unknown or ill-typed keys with a message naming them.
    fn from_config(config: &serde_json::Value) -> Result<Self, String> {
        let _ = config;
        Err("this drafter implements neither from_config nor from_config_in".to_owned())
    }

    /// [`Drafter::from_config`], also given the folder holding the plugin's `plugin.toml`:
    /// resolve relative paths of the configuration against it, never against the working
    /// directory.
    fn from_config_in(config: &serde_json::Value, plugin_dir: &Path) -> Result<Self, String> {
        let _ = plugin_dir;
        Self::from_config(config)
    }

    /// Resident bytes of the drafter's weights.
    fn weights_bytes(&self) -> u64 {
        0
    }

    /// Starts a request. Refuse targets the drafter cannot serve (wrong family, vocabulary…).
    fn open(&self, target: &TargetInfo, sampling: &SamplingInfo) -> Result<Self::Session, String> {
        let _ = (target, sampling);
        Err("this drafter implements neither open nor open_for".to_owned())
    }

    /// [`Drafter::open`] with the target at hand: read [`Target::spec`] to check the pairing
    /// (hidden size, vocabulary, layer kinds…) and refuse it with a clear message.
    fn open_for(
        &self,
        info: &TargetInfo,
        target: &Target<'_>,
        sampling: &SamplingInfo,
    ) -> Result<Self::Session, String> {
        let _ = target;
        self.open(info, sampling)
    }
}

/// Hidden states of verified positions (see [`DrafterSession::receive_taps`]).
pub struct Taps {
    /// Absolute position of row 0.
    pub first_position: u64,
    /// One `[rows, hidden]` array per tap point, in the order of
    /// [`DrafterSession::tap_layers`].
    pub layers: Vec<Array>,
}

impl Taps {
    /// Number of positions (rows) delivered.
    pub fn rows(&self) -> usize {
        self.layers.first().map_or(0, |a| a.shape()[0] as usize)
    }
}

/// A target layer's keys and values (see [`crate::abi::DonorKv`] for their exact content).
/// Valid during the call that lent them: copy what must outlive it.
pub struct DonorKv {
    /// `[1, kv_heads, n, head_dim]`.
    pub keys: Array,
    pub values: Array,
    /// Absolute position of entry 0; entries are contiguous.
    pub first_position: u64,
}

impl DonorKv {
    /// Number of entries.
    pub fn len(&self) -> usize {
        self.keys.shape()[2] as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Absolute position one past the last entry.
    pub fn end_position(&self) -> u64 {
        self.first_position + self.len() as u64
    }
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
    /// Not read by hosts of interface revision 2, which prefill the whole prompt for every
    /// source ([`PrefillMode`]): the first `draft` call's history already ends with the first
    /// generated token. Kept so that drafters written for revision 1 still compile.
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

    /// The tap points this session reads (asked once, after `open`): `-1` the scaled
    /// embeddings, `i` the residual stream leaving layer `i`, `num_layers` the final-norm
    /// hidden state ([`TargetSpec::final_hidden_tap`]).
    fn tap_layers(&self) -> Vec<i32> {
        Vec::new()
    }

    /// Hidden states at [`DrafterSession::tap_layers`] of positions the target verified: the
    /// prompt (before `prefill`), then each round's verified positions (before `commit`):
    /// its first token and the accepted drafts. Every position arrives once, in order; the
    /// arrays are yours to keep.
    fn receive_taps(&mut self, _taps: Taps) -> Result<(), String> {
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

    /// The target's description: layer kinds, heads, RoPE, donor layers, dtype, config.
    pub fn spec(&self) -> Result<TargetSpec, String> {
        let json = into_result(self.port.describe())?;
        serde_json::from_str(json.as_str())
            .map_err(|e| format!("the host's target description does not parse: {e}"))
    }

    /// Keys and values of the KV-owning layer `layer` for every position the target has
    /// processed and kept, oldest first. Valid during this call only.
    pub fn donor_kv(&self, layer: usize) -> Result<DonorKv, String> {
        let kv = into_result(self.port.donor_kv(layer as u32))?;
        Ok(DonorKv {
            keys: kv.keys.into_array(),
            values: kv.values.into_array(),
            first_position: kv.first_position,
        })
    }
}

fn into_result<T>(r: RResult<T, RString>) -> Result<T, String> {
    match r {
        ROk(v) => Ok(v),
        RErr(e) => Err(e.into_string()),
    }
}

/// The text of a caught panic's payload (its message, when it has one).
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
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

    fn open(
        &self,
        info: TargetInfo,
        target: TargetPortRef<'_>,
        sampling: SamplingInfo,
    ) -> RResult<DraftSourceBox, RString> {
        guarded(|| {
            let session = self
                .0
                .open_for(&info, &Target { port: target }, &sampling)?;
            Ok(DraftSource_TO::from_value(
                SessionAdapter(session),
                TD_Opaque,
            ))
        })
    }
}

impl<S: DrafterSession> abi::DraftSource for SessionAdapter<S> {
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

    fn tap_layers(&self) -> RVec<i32> {
        // A panic here leaves the session without taps; its next call will tell.
        catch_unwind(AssertUnwindSafe(|| self.0.tap_layers()))
            .map(RVec::from)
            .unwrap_or_default()
    }

    fn receive_taps(&mut self, taps: TapRows) -> RResult<(), RString> {
        guarded(|| {
            let taps = Taps {
                first_position: taps.first_position,
                layers: taps.layers.into_iter().map(Tensor::into_array).collect(),
            };
            self.0.receive_taps(taps)
        })
    }
}

/// Builds a provider from JSON configuration, relative paths resolved against `plugin_dir`
/// (the working directory when not given); what `declare_drafter_plugin!` exports.
pub fn new_provider<D: Drafter>(
    config_json: &str,
    plugin_dir: Option<&Path>,
) -> RResult<DraftProviderBox, RString> {
    guarded(|| {
        // Install mlx-rs's error handler into this library's own mlx-c copy before anything
        // else: until the first checked op, mlx-c's default handler would exit the process.
        Array::from_int(0)
            .eval()
            .map_err(|e| format!("MLX is not usable in the plugin: {e}"))?;
        let config: serde_json::Value = serde_json::from_str(config_json)
            .map_err(|e| format!("plugin configuration is not valid JSON: {e}"))?;
        let drafter = match plugin_dir {
            Some(dir) => D::from_config_in(&config, dir)?,
            None => D::from_config(&config)?,
        };
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

/// The random key of a drafter's draw at emitted index `index` of a request with `seed`:
/// splitmix64 of the seed mixed with `salt`, then with the index. Each drafter passes a
/// constant of its own as `salt`, so its draws never coincide with the host's verification
/// coin, which is keyed by the same seed and index, nor with another drafter's.
pub fn draft_key(salt: u64, seed: u64, index: u64) -> u64 {
    let mix = |mut x: u64| {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    };
    mix(mix(seed ^ salt) ^ index)
}
