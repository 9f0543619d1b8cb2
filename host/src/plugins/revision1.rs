//! Plugins built against interface revision 1, served through the current interface.
//!
//! Such a library's provider and sessions are revision-1 trait objects
//! (`mlx_spec_plugin_api::abi::r1`). Wrapped here in the current traits, the verify loop sees
//! one interface: a revision-1 session reads no taps and no K/V, opens without the target's
//! port, and is lent a revision-1 port (position, embeddings, logits) that forwards to the
//! current one.

use abi_stable::sabi_trait::TD_Opaque;
use abi_stable::std_types::{ROk, RResult, RSlice, RString, RVec};
use mlx_spec_plugin_api::abi::{
    self, r1, Draft, DraftProviderBox, DraftProvider_TO, DraftSourceBox, DraftSource_TO,
    SamplingInfo, TapRows, TargetInfo, TargetPortRef,
};
use mlx_spec_plugin_api::tensor::{Tensor, TensorRef};

/// A revision-1 provider as a current one.
pub fn adapt(provider: r1::DraftProviderBox) -> DraftProviderBox {
    DraftProvider_TO::from_value(Provider(provider), TD_Opaque)
}

struct Provider(r1::DraftProviderBox);
struct Source(r1::DraftSourceBox);

/// The current port, lent to a revision-1 session as a revision-1 port.
struct Port<'a>(TargetPortRef<'a>);

impl r1::TargetPort for Port<'_> {
    fn position(&self) -> u64 {
        self.0.position()
    }

    fn embed(&self, ids: RSlice<'_, u32>) -> RResult<Tensor, RString> {
        self.0.embed(ids)
    }

    fn logits_from_hidden(&self, hidden: TensorRef<'_>) -> RResult<Tensor, RString> {
        self.0.logits_from_hidden(hidden)
    }
}

fn lend<'b, 'a: 'b>(port: &'b Port<'a>) -> r1::TargetPortRef<'b> {
    r1::TargetPort_TO::from_ptr(port, TD_Opaque)
}

impl abi::DraftProvider for Provider {
    fn weights_bytes(&self) -> u64 {
        self.0.weights_bytes()
    }

    fn open(
        &self,
        info: TargetInfo,
        _target: TargetPortRef<'_>,
        sampling: SamplingInfo,
    ) -> RResult<DraftSourceBox, RString> {
        self.0
            .open(info, sampling)
            .map(|source| DraftSource_TO::from_value(Source(source), TD_Opaque))
    }
}

impl abi::DraftSource for Source {
    fn prefill(
        &mut self,
        prompt: RSlice<'_, u32>,
        target: TargetPortRef<'_>,
    ) -> RResult<(), RString> {
        let port = Port(target);
        self.0.prefill(prompt, lend(&port))
    }

    fn draft(
        &mut self,
        history: RSlice<'_, u32>,
        n: u32,
        step_base: u64,
        target: TargetPortRef<'_>,
    ) -> RResult<Draft, RString> {
        let port = Port(target);
        self.0.draft(history, n, step_base, lend(&port))
    }

    fn commit(
        &mut self,
        drafted: u32,
        accepted: u32,
        emitted: RSlice<'_, u32>,
    ) -> RResult<(), RString> {
        self.0.commit(drafted, accepted, emitted)
    }

    fn tap_layers(&self) -> RVec<i32> {
        RVec::new()
    }

    fn receive_taps(&mut self, _taps: TapRows) -> RResult<(), RString> {
        ROk(())
    }
}
