//! The row's attention (GLM-4.5 `glm4_moe`): grouped-query attention with q/k/v biases, an
//! optional per-head RMSNorm of queries and keys before RoPE, scale `head_dim^-1/2`, over the
//! row's own cache. New rows see every cached row before them and themselves (causal).

use mlx_spec_plugin_api::mlx_rs::fast::{
    rms_norm, scaled_dot_product_attention, ScaledDotProductAttentionMask,
};
use mlx_spec_plugin_api::mlx_rs::Array;

use crate::cache::RowCache;
use crate::config::MtpConfig;
use crate::linear::{mlx_err, Linear, Loader};
use crate::rope::RowAngles;

pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// Per-head norms of queries and keys (`use_qk_norm`).
    qk_norm: Option<(Array, Array)>,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    eps: f32,
}

impl Attention {
    pub fn load(config: &MtpConfig, loader: &Loader<'_>) -> Result<Self, String> {
        let (h, hd) = (config.hidden_size, config.head_dim);
        let (nh, nkv) = (config.num_attention_heads, config.num_key_value_heads);
        let bias = config.attention_bias;
        let qk_norm = if config.use_qk_norm {
            Some((
                loader.float("self_attn.q_norm.weight", &[hd])?,
                loader.float("self_attn.k_norm.weight", &[hd])?,
            ))
        } else {
            None
        };
        Ok(Attention {
            q_proj: loader.linear("self_attn.q_proj", nh * hd, h, bias)?,
            k_proj: loader.linear("self_attn.k_proj", nkv * hd, h, bias)?,
            v_proj: loader.linear("self_attn.v_proj", nkv * hd, h, bias)?,
            o_proj: loader.linear("self_attn.o_proj", h, nh * hd, false)?,
            qk_norm,
            heads: nh as i32,
            kv_heads: nkv as i32,
            head_dim: hd as i32,
            eps: config.rms_norm_eps,
        })
    }

    /// `x` `[rows, H]` (already normed) at the positions of `angles`; appends the rows' keys
    /// and values to `cache` and returns the attention output `[rows, H]`.
    pub fn forward(
        &self,
        x: &Array,
        angles: &RowAngles,
        cache: &mut RowCache,
    ) -> Result<Array, String> {
        let e = mlx_err("MTP attention");
        let rows = x.shape()[0];
        // [rows, heads * hd] -> [1, heads, rows, hd]
        let split = |y: Array, heads: i32| {
            y.reshape(&[1, rows, heads, self.head_dim])
                .and_then(|y| y.transpose_axes(&[0, 2, 1, 3]))
                .map_err(&e)
        };
        let mut q = split(self.q_proj.forward(x)?, self.heads)?;
        let mut k = split(self.k_proj.forward(x)?, self.kv_heads)?;
        let v = split(self.v_proj.forward(x)?, self.kv_heads)?;
        if let Some((q_norm, k_norm)) = &self.qk_norm {
            q = rms_norm(&q, Some(q_norm), self.eps).map_err(&e)?;
            k = rms_norm(&k, Some(k_norm), self.eps).map_err(&e)?;
        }
        let q = angles.apply(&q)?;
        let k = angles.apply(&k)?;
        let (keys, values) = cache.append(k, v)?;
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        // The new rows are the cache's last: MLX's causal mask lines queries up with the last
        // keys, so row i sees every earlier row and itself.
        let mask = (rows > 1).then_some(ScaledDotProductAttentionMask::Causal);
        let out = scaled_dot_product_attention(&q, &keys, &values, scale, mask, None)
            .and_then(|o| o.transpose_axes(&[0, 2, 1, 3]))
            .and_then(|o| o.reshape(&[rows, self.heads * self.head_dim]))
            .map_err(&e)?;
        self.o_proj.forward(&out)
    }

    pub fn nbytes(&self) -> usize {
        self.q_proj.nbytes()
            + self.k_proj.nbytes()
            + self.v_proj.nbytes()
            + self.o_proj.nbytes()
            + self
                .qk_norm
                .as_ref()
                .map_or(0, |(q, k)| q.nbytes() + k.nbytes())
    }
}
