//! The MTP row: what one row computes from the target's hidden state at position i and the
//! target's embedding of the token at i + 1.
//!
//! ```text
//! z = concat(rms(e, enorm), rms(h, hnorm))      embedding first (GLM, DeepSeek-V3)
//! x = eh_proj(z)                                 [rows, H]
//! x = x + attention(rms(x, input_layernorm))     appends the rows to the row's cache
//! o = x + mlp(rms(x, post_attention_layernorm))  the block's output
//! head_in = rms(o, shared_head.norm)             the target's LM head reads it
//! ```
//!
//! RMSNorms use the plain weight (`w * x / rms(x)`), not Gemma's `1 + w`. Rows handed in
//! together are consecutive positions and see each other causally.

use std::path::Path;

use mlx_spec_plugin_api::checkpoint::Checkpoint;
use mlx_spec_plugin_api::mlx_rs::fast::rms_norm;
use mlx_spec_plugin_api::mlx_rs::ops::concatenate;
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

use crate::attention::Attention;
use crate::cache::RowCache;
use crate::config::MtpConfig;
use crate::linear::{is_float, mlx_err, Linear, Loader};
use crate::mlp::Mlp;
use crate::rope::RowAngles;

pub struct MtpRow {
    pub config: MtpConfig,
    /// The compute dtype; inputs are cast to it.
    pub dtype: Dtype,
    enorm: Array,
    hnorm: Array,
    eh_proj: Linear,
    input_layernorm: Array,
    attention: Attention,
    post_attention_layernorm: Array,
    mlp: Mlp,
    shared_head_norm: Array,
}

/// One forward's results, lazy until read: `[rows, H]` each.
pub struct RowOutput {
    pub eh_out: Array,
    /// `o`, before `shared_head.norm`.
    pub block_out: Array,
    /// `rms(o, shared_head.norm)`, the LM head's input.
    pub head_in: Array,
}

impl MtpRow {
    /// Loads `config.json` and the row's tensors from a checkpoint folder; `dtype`: the compute
    /// dtype, or `None` for the checkpoint's own float dtype.
    pub fn load(dir: &Path, dtype: Option<Dtype>) -> Result<Self, String> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| {
            format!(
                "cannot read {}: {e} (set the drafter's `checkpoint` to an MTP checkpoint folder)",
                config_path.display()
            )
        })?;
        let config = MtpConfig::parse(&text, &config_path.display().to_string())?;
        let checkpoint = Checkpoint::open_dir(dir)?;
        let prefix = config.prefix();
        let probe = format!("{prefix}enorm.weight");
        if !checkpoint.contains(&probe) {
            return Err(format!(
                "{} holds no MTP row: {probe} is missing (the row's tensors are named model.layers.{{N}}.*, N = {})",
                dir.display(),
                config.layer_index
            ));
        }
        let stored = checkpoint
            .dtype(&probe)
            .filter(|d| is_float(*d))
            .unwrap_or(Dtype::Float32);
        let loader = Loader {
            checkpoint: &checkpoint,
            prefix,
            dtype: dtype.unwrap_or(stored),
            quant: &config.quantization,
        };
        let h = config.hidden_size;
        Ok(MtpRow {
            enorm: loader.float("enorm.weight", &[h])?,
            hnorm: loader.float("hnorm.weight", &[h])?,
            eh_proj: loader.linear("eh_proj", h, 2 * h, false)?,
            input_layernorm: loader.float("input_layernorm.weight", &[h])?,
            attention: Attention::load(&config, &loader)?,
            post_attention_layernorm: loader.float("post_attention_layernorm.weight", &[h])?,
            mlp: Mlp::load(&config, &loader)?,
            shared_head_norm: loader.float("shared_head.norm.weight", &[h])?,
            dtype: loader.dtype,
            config,
        })
    }

    pub fn nbytes(&self) -> usize {
        [
            &self.enorm,
            &self.hnorm,
            &self.input_layernorm,
            &self.post_attention_layernorm,
            &self.shared_head_norm,
        ]
        .iter()
        .map(|a| a.nbytes())
        .sum::<usize>()
            + self.eh_proj.nbytes()
            + self.attention.nbytes()
            + self.mlp.nbytes()
    }

    fn cast(&self, a: &Array) -> Result<Array, String> {
        let h = self.config.hidden_size as i32;
        let a = a.reshape(&[-1, h]).map_err(|e| {
            format!(
                "an MTP input of shape {:?} is not rows of the hidden size {h}: {e}",
                a.shape()
            )
        })?;
        if a.dtype() == self.dtype {
            Ok(a)
        } else {
            a.as_dtype(self.dtype)
                .map_err(mlx_err("casting an MTP input"))
        }
    }

    /// Builds rows at positions `cache.next_position()..` from the target's embeddings of the
    /// tokens `embeddings` and the hidden states `hiddens` (`[rows, H]` each), appending them
    /// to `cache`.
    pub fn forward(
        &self,
        embeddings: &Array,
        hiddens: &Array,
        cache: &mut RowCache,
    ) -> Result<RowOutput, String> {
        let e = mlx_err("MTP row");
        let c = &self.config;
        let eps = c.rms_norm_eps;
        let embeddings = self.cast(embeddings)?;
        let hiddens = self.cast(hiddens)?;
        let rows = embeddings.shape()[0];
        if hiddens.shape()[0] != rows {
            return Err(format!(
                "{rows} embeddings but {} hidden states for the MTP rows",
                hiddens.shape()[0]
            ));
        }
        let en = rms_norm(&embeddings, Some(&self.enorm), eps).map_err(&e)?;
        let hn = rms_norm(&hiddens, Some(&self.hnorm), eps).map_err(&e)?;
        let z = if c.hidden_first {
            concatenate(&[hn, en], -1)
        } else {
            concatenate(&[en, hn], -1)
        }
        .map_err(&e)?;
        let eh_out = self.eh_proj.forward(&z)?;
        let first = cache.next_position();
        let angles = RowAngles::new(c.rope_theta, c.rotary_dim, first, rows as usize, self.dtype)?;
        let attn_in = rms_norm(&eh_out, Some(&self.input_layernorm), eps).map_err(&e)?;
        let x = eh_out
            .add(self.attention.forward(&attn_in, &angles, cache)?)
            .map_err(&e)?;
        let mlp_in = rms_norm(&x, Some(&self.post_attention_layernorm), eps).map_err(&e)?;
        let block_out = x.add(self.mlp.forward(&mlp_in)?).map_err(&e)?;
        let head_in = rms_norm(&block_out, Some(&self.shared_head_norm), eps).map_err(&e)?;
        Ok(RowOutput {
            eh_out,
            block_out,
            head_in,
        })
    }
}
