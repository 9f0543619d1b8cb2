//! The stable ABI: the types that cross between the host and a plugin library, checked by
//! abi_stable's layout comparison when the library loads.
//!
//! A plugin exports one root module, [`PluginModule`]; its `new_provider` builds a
//! [`DraftProviderBox`] (one per loaded drafter, lives as long as the server), which `open`s a
//! [`DraftSourceBox`] per request. During a request the host lends the source a
//! [`TargetPortRef`] for each call: the capabilities of the target model the drafter may use.
//! Every method returns errors as values; the SDK adapters catch panics before they reach
//! this layer (a panic crossing it would end the process).

#![allow(non_local_definitions)] // emitted by #[sabi_trait] on current Rust

use abi_stable::library::RootModule;
use abi_stable::sabi_types::RRef;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::{RBox, ROption, RResult, RSlice, RStr, RString, RVec};
use abi_stable::{declare_root_module_statics, package_version_strings, sabi_trait, StableAbi};

use crate::tensor::{Tensor, TensorRef};

/// How a source asked the host to prefill the target. Kept so that libraries built against
/// earlier SDKs still load; the host now prefills the whole prompt for every source, as plain
/// decoding does, and samples the first token from it (the `Full` shape). Leaving the last
/// prompt token to head the first verify window (`TailSplit`) made the prompt's cache and the
/// first token come out of other operations than plain decoding's, and speculative output
/// must equal plain output.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillMode {
    /// Was: the last prompt token is left pending and heads the first verify window. Now
    /// served as `Full`.
    TailSplit,
    /// The whole prompt runs through the target and the first token is sampled from it.
    Full,
}

/// What a drafter learns about the target when a request opens.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct TargetInfo {
    /// Model family, e.g. `gemma4`.
    pub family: RString,
    /// Hash of the target's config; drafters trained for one target can refuse others.
    pub fingerprint: u64,
    pub vocab_size: u32,
    pub hidden_size: u32,
    pub num_layers: u32,
}

/// The request's sampling settings (drafters that sample should use the same ones).
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct SamplingInfo {
    /// 0 = greedy.
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
}

/// One round's proposal.
#[repr(C)]
#[derive(StableAbi, Debug)]
pub struct Draft {
    /// Proposed tokens; the length is authoritative (0 = skip drafting this round), and must
    /// not exceed the `n` the host asked for.
    pub tokens: RVec<u32>,
    /// Optionally, the distributions the tokens were sampled from: float32 `[len, vocab]`.
    /// With them the host verifies by rejection sampling; without, by exact token match.
    pub probs: ROption<Tensor>,
}

/// Target capabilities lent to a source for the duration of one call.
#[sabi_trait]
pub trait TargetPort {
    /// Tokens the target has processed (its KV cache length).
    fn position(&self) -> u64;

    /// Scaled token embeddings `[1, len, hidden]`, as the target's first layer sees them.
    fn embed(&self, ids: RSlice<'_, u32>) -> RResult<Tensor, RString>;

    /// Float32 logits `[rows, vocab]` from final-norm hidden states `[.., rows, hidden]`.
    #[sabi(last_prefix_field)]
    fn logits_from_hidden(&self, hidden: TensorRef<'_>) -> RResult<Tensor, RString>;
}

/// A borrowed target port.
pub type TargetPortRef<'a> = TargetPort_TO<'a, RRef<'a, ()>>;

/// Per-request drafter state.
#[sabi_trait]
pub trait DraftSource: Send {
    /// The prefill the source asked for (see [`PrefillMode`]: the host no longer reads it).
    fn prefill_mode(&self) -> PrefillMode;

    /// Called once with the prompt before the first round.
    fn prefill(
        &mut self,
        prompt: RSlice<'_, u32>,
        target: TargetPortRef<'_>,
    ) -> RResult<(), RString>;

    /// Proposes up to `n` tokens to follow `history` (prompt plus every emitted token; its
    /// last token is the one the target verifies next). `step_base` is the emitted index of
    /// the first proposed token, for drafters that sample with (seed, index) keys.
    fn draft(
        &mut self,
        history: RSlice<'_, u32>,
        n: u32,
        step_base: u64,
        target: TargetPortRef<'_>,
    ) -> RResult<Draft, RString>;

    /// After verification: `accepted` of the `drafted` tokens were kept and `emitted` were
    /// appended to the history (the accepted ones plus the target's own next token).
    #[sabi(last_prefix_field)]
    fn commit(
        &mut self,
        drafted: u32,
        accepted: u32,
        emitted: RSlice<'_, u32>,
    ) -> RResult<(), RString>;
}

/// An owned per-request source.
pub type DraftSourceBox = DraftSource_TO<'static, RBox<()>>;

/// A loaded drafter (owns its weights).
#[sabi_trait]
pub trait DraftProvider: Send + Sync {
    /// Resident bytes of the drafter's own weights (0 for weightless drafters).
    fn weights_bytes(&self) -> u64;

    /// Starts a request against a target.
    #[sabi(last_prefix_field)]
    fn open(&self, target: TargetInfo, sampling: SamplingInfo) -> RResult<DraftSourceBox, RString>;
}

/// An owned provider.
pub type DraftProviderBox = DraftProvider_TO<'static, RBox<()>>;

/// The root module every plugin library exports.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModuleRef)))]
#[sabi(missing_field(panic))]
pub struct PluginModule {
    /// [`crate::ABI_MAJOR`] of the SDK the plugin was built with.
    pub abi_major: u32,
    /// MLX version of the headers the plugin's mlx-c copy was compiled against.
    pub mlx_headers: RStr<'static>,
    /// Plugin name and version (they must match the manifest).
    pub name: RStr<'static>,
    pub version: RStr<'static>,
    /// Builds the drafter from its configuration (a JSON object: manifest defaults merged
    /// with the run's overrides).
    #[sabi(last_prefix_field)]
    pub new_provider: extern "C" fn(config_json: RStr<'_>) -> RResult<DraftProviderBox, RString>,
}

impl RootModule for PluginModuleRef {
    declare_root_module_statics! {PluginModuleRef}
    const BASE_NAME: &'static str = "mlx_spec_drafter";
    const NAME: &'static str = "mlx_spec_drafter";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}
