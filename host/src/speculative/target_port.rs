//! The target capabilities the host lends a drafter during each call.

use abi_stable::std_types::{RErr, ROk, RResult, RSlice, RString};
use mlx_spec_plugin_api::abi::{TargetInfo, TargetPort};
use mlx_spec_plugin_api::tensor::{Tensor, TensorRef};

use crate::model::gemma4::Gemma4Model;

/// A read-only view of the target at one point of a request.
pub struct HostTarget<'a> {
    pub model: &'a Gemma4Model,
    pub position: u64,
}

fn result<T>(r: anyhow::Result<T>) -> RResult<T, RString> {
    match r {
        Ok(v) => ROk(v),
        Err(e) => RErr(RString::from(format!("{e:#}"))),
    }
}

impl TargetPort for HostTarget<'_> {
    fn position(&self) -> u64 {
        self.position
    }

    fn embed(&self, ids: RSlice<'_, u32>) -> RResult<Tensor, RString> {
        result(self.model.embed(ids.as_slice()).map(Tensor::from_array))
    }

    fn logits_from_hidden(&self, hidden: TensorRef<'_>) -> RResult<Tensor, RString> {
        result(
            self.model
                .logits_from_hidden(&hidden.view())
                .map(Tensor::from_array),
        )
    }
}

/// What a drafter is told about the target when a request opens.
pub fn target_info(model: &Gemma4Model) -> TargetInfo {
    let c = &model.config;
    // FNV-1a over the shape-defining fields: equal for the same architecture and vocabulary.
    let fields = [
        c.vocab_size,
        c.hidden_size,
        c.num_layers,
        c.num_heads,
        c.intermediate_size,
        c.sliding_window,
    ];
    let fingerprint = fields
        .iter()
        .flat_map(|f| (*f as u64).to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        });
    TargetInfo {
        family: "gemma4".into(),
        fingerprint,
        vocab_size: c.vocab_size as u32,
        hidden_size: c.hidden_size as u32,
        num_layers: c.num_layers as u32,
    }
}
