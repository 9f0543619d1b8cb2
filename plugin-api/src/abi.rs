//! The stable ABI: the types that cross between the host and a plugin library, checked by
//! abi_stable's layout comparison when the library loads.
//!
//! A plugin exports one root module, [`PluginModule`]; its `new_provider` builds a
//! [`DraftProviderBox`] (one per loaded drafter, lives as long as the server), which `open`s a
//! [`DraftSourceBox`] per request. During a request the host lends the source a
//! [`TargetPortRef`] for each call: the capabilities of the target model the drafter may use.
//! Every method returns errors as values; the SDK adapters catch panics before they reach
//! this layer (a panic crossing it would end the process).
//!
//! # Revisions: a newer host keeps loading older plugins
//!
//! abi_stable compares the layout of every type reachable from the root module when a library
//! loads, and accepts a library whose prefix types and trait objects have *more* fields or
//! methods than the host knows, never fewer: its model is an older host loading newer
//! libraries. A host whose traits had grown would refuse every library built before (the
//! compatibility test in `tests/compat` showed it: "too many fields"). So each interface
//! revision is a set of types of its own. The current one is defined here; earlier ones are
//! kept frozen in submodules ([`r1`]) for the host, which loads a library through the types of
//! the revision the library exports as [`REVISION_SYMBOL`] (absent: revision 1) and adapts it
//! to the current interface. The version string abi_stable checks, [`INTERFACE_VERSION`], stays
//! the same for every revision: abi_stable refuses any other `0.y` outright, and the layouts
//! already tell revisions apart. A change of meaning that layouts cannot show raises
//! [`crate::ABI_MAJOR`], and the host then refuses older plugins by name.

#![allow(non_local_definitions)] // emitted by #[sabi_trait] on current Rust

use abi_stable::library::RootModule;
use abi_stable::sabi_types::RRef;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::{RBox, ROption, RResult, RSlice, RStr, RString, RVec};
use abi_stable::{declare_root_module_statics, sabi_trait, StableAbi};

use crate::tensor::{Tensor, TensorRef};

pub mod r1;

/// The version string abi_stable checks at load, the same for every revision (see the module
/// documentation); it has nothing to do with the crates' versions.
pub const INTERFACE_VERSION: &str = "0.1.0";

/// The current interface revision: 1 = the first interface (ids, embeddings, logits from
/// hidden states; [`r1`]); 2 = hidden-state taps, donor K/V, the target's description, a
/// port-aware `open`, and the plugin's own folder for `new_provider`.
pub const INTERFACE_REVISION: u32 = 2;

/// Exported `u32` (revision 2 on): the revision whose types a library's root module has.
pub const REVISION_SYMBOL: &[u8] = b"mlx_spec_interface_revision\0";

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
    fn logits_from_hidden(&self, hidden: TensorRef<'_>) -> RResult<Tensor, RString>;

    /// The target's shape as JSON ([`crate::target_spec::TargetSpec`]): layer kinds, heads,
    /// head sizes, sliding window, RoPE, dtype, donor layers, its config.json.
    fn describe(&self) -> RResult<RString, RString>;

    /// The keys and values the target's KV-owning layer `layer` holds for the positions it
    /// has processed and kept (never a rejected draft), oldest first. Lent for this call only:
    /// see [`DonorKv`].
    #[sabi(last_prefix_field)]
    fn donor_kv(&self, layer: u32) -> RResult<DonorKv, RString>;
}

/// A borrowed target port.
pub type TargetPortRef<'a> = TargetPort_TO<'a, RRef<'a, ()>>;

/// Keys and values of one KV-owning target layer.
///
/// `keys`/`values` are `[1, kv_heads, n, head_dim]` in the target's activation dtype: K after
/// the layer's `k_norm` and RoPE at each entry's position, V after `v_norm` (for a layer with
/// `attention_k_eq_v`, V is made from the K projection, before RoPE). Entry `i` holds absolute
/// position `first_position + i`; the entries are contiguous and end at the last position the
/// target processed. For a sliding layer they cover at least the window before the next
/// position, often more: the drafter picks what it attends to by position.
///
/// The arrays are new handles, owned by the receiver, but their data may be the target's
/// cache buffer itself, which the target's fused kernels write in place: read them during the
/// call that received them, and copy (and evaluate) what must outlive it.
#[repr(C)]
#[derive(StableAbi, Debug)]
pub struct DonorKv {
    pub keys: Tensor,
    pub values: Tensor,
    pub first_position: u64,
}

/// Hidden states of positions the target verified, at the tap points a source asked for (see
/// [`DraftSource::tap_layers`]).
///
/// `layers[j]` is `[rows, hidden]` for the `j`-th tap point asked for; row `r` belongs to
/// absolute position `first_position + r`. Ownership moves to the receiver; the arrays hold
/// their own data (nothing writes them afterwards).
#[repr(C)]
#[derive(StableAbi, Debug)]
pub struct TapRows {
    pub first_position: u64,
    pub layers: RVec<Tensor>,
}

/// Per-request drafter state.
#[sabi_trait]
pub trait DraftSource: Send {
    /// Called once with the prompt before the first round (after the prompt's taps).
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
    fn commit(
        &mut self,
        drafted: u32,
        accepted: u32,
        emitted: RSlice<'_, u32>,
    ) -> RResult<(), RString>;

    /// The tap points whose hidden states this source reads, asked once after `open`: `-1`
    /// the scaled embeddings (the input of layer 0), `i` in `0..num_layers` the residual stream
    /// leaving decoder layer `i` (after its layer scalar), `num_layers` the final-norm hidden
    /// state (the LM head's input). Empty: none.
    fn tap_layers(&self) -> RVec<i32>;

    /// Hidden states of positions the target has verified, at [`tap_layers`]'s points. Called
    /// with the whole prompt before `prefill`, and before every `commit` with the round's
    /// verified positions: its first token and the accepted drafts (rejected positions never
    /// arrive). Rounds decoded plainly arrive too, so the rows a source receives cover every
    /// position once, in order.
    ///
    /// [`tap_layers`]: DraftSource::tap_layers
    #[sabi(last_prefix_field)]
    fn receive_taps(&mut self, taps: TapRows) -> RResult<(), RString>;
}

/// An owned per-request source.
pub type DraftSourceBox = DraftSource_TO<'static, RBox<()>>;

/// A loaded drafter (owns its weights).
#[sabi_trait]
pub trait DraftProvider: Send + Sync {
    /// Resident bytes of the drafter's own weights (0 for weightless drafters).
    fn weights_bytes(&self) -> u64;

    /// Starts a request against a target; the port lets the drafter check the pairing
    /// against the target's description (and refuse it) before allocating.
    #[sabi(last_prefix_field)]
    fn open(
        &self,
        info: TargetInfo,
        target: TargetPortRef<'_>,
        sampling: SamplingInfo,
    ) -> RResult<DraftSourceBox, RString>;
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
    /// with the run's overrides); relative paths in it resolve against `plugin_dir`, the
    /// folder holding the plugin's manifest.
    #[sabi(last_prefix_field)]
    pub new_provider: extern "C" fn(
        config_json: RStr<'_>,
        plugin_dir: RStr<'_>,
    ) -> RResult<DraftProviderBox, RString>,
}

impl RootModule for PluginModuleRef {
    declare_root_module_statics! {PluginModuleRef}
    const BASE_NAME: &'static str = "mlx_spec_drafter";
    const NAME: &'static str = "mlx_spec_drafter";
    const VERSION_STRINGS: VersionStrings = VersionStrings::new(INTERFACE_VERSION);
}
