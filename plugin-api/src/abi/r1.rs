//! Interface revision 1, frozen: the trait objects and root module of the first plugin
//! interface, exactly as libraries built against it carry them in their layouts. The host
//! loads such a library through these types and adapts it to the current interface; nothing
//! here may change, or those libraries stop loading (`tests/compat` builds one to prove it).
//!
//! The plain structs they use (`TargetInfo`, `SamplingInfo`, `Draft`, `PrefillMode`) did not
//! change and are shared with the current interface.

use abi_stable::library::RootModule;
use abi_stable::sabi_types::{RRef, VersionStrings};
use abi_stable::std_types::{RBox, RResult, RSlice, RStr, RString};
use abi_stable::{declare_root_module_statics, sabi_trait, StableAbi};

use super::{Draft, PrefillMode, SamplingInfo, TargetInfo, INTERFACE_VERSION};
use crate::tensor::{Tensor, TensorRef};

/// Revision 1's target port: position, embeddings, logits from hidden states.
#[sabi_trait]
pub trait TargetPort {
    fn position(&self) -> u64;

    fn embed(&self, ids: RSlice<'_, u32>) -> RResult<Tensor, RString>;

    #[sabi(last_prefix_field)]
    fn logits_from_hidden(&self, hidden: TensorRef<'_>) -> RResult<Tensor, RString>;
}

pub type TargetPortRef<'a> = TargetPort_TO<'a, RRef<'a, ()>>;

/// Revision 1's per-request drafter state.
#[sabi_trait]
pub trait DraftSource: Send {
    fn prefill_mode(&self) -> PrefillMode;

    fn prefill(
        &mut self,
        prompt: RSlice<'_, u32>,
        target: TargetPortRef<'_>,
    ) -> RResult<(), RString>;

    fn draft(
        &mut self,
        history: RSlice<'_, u32>,
        n: u32,
        step_base: u64,
        target: TargetPortRef<'_>,
    ) -> RResult<Draft, RString>;

    #[sabi(last_prefix_field)]
    fn commit(
        &mut self,
        drafted: u32,
        accepted: u32,
        emitted: RSlice<'_, u32>,
    ) -> RResult<(), RString>;
}

pub type DraftSourceBox = DraftSource_TO<'static, RBox<()>>;

/// Revision 1's loaded drafter.
#[sabi_trait]
pub trait DraftProvider: Send + Sync {
    fn weights_bytes(&self) -> u64;

    #[sabi(last_prefix_field)]
    fn open(&self, target: TargetInfo, sampling: SamplingInfo) -> RResult<DraftSourceBox, RString>;
}

pub type DraftProviderBox = DraftProvider_TO<'static, RBox<()>>;

/// Revision 1's root module.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModuleRef)))]
#[sabi(missing_field(panic))]
pub struct PluginModule {
    pub abi_major: u32,
    pub mlx_headers: RStr<'static>,
    pub name: RStr<'static>,
    pub version: RStr<'static>,
    #[sabi(last_prefix_field)]
    pub new_provider: extern "C" fn(config_json: RStr<'_>) -> RResult<DraftProviderBox, RString>,
}

impl RootModule for PluginModuleRef {
    declare_root_module_statics! {PluginModuleRef}
    const BASE_NAME: &'static str = "mlx_spec_drafter";
    const NAME: &'static str = "mlx_spec_drafter";
    const VERSION_STRINGS: VersionStrings = VersionStrings::new(INTERFACE_VERSION);
}
