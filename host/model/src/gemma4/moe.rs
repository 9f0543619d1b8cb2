//! The mixture-of-experts branch (26B-A4B style): a router over the residual stream picks
//! `top_k` experts per token; each expert is a gated GELU MLP.
//!
//! Expert weights come either as HF's fused `experts.gate_up_proj` `[E, 2I, H]` +
//! `experts.down_proj` `[E, H, I]`, or as mlx-community's `experts.switch_glu.{gate,up,down}_proj`
//! (optionally quantized). Both become three stacked `[E, out, in]` matrices.

use super::norm::rms_norm;
use anyhow::Result;
use mlx_rs::ops::indexing::{take_along_axis, IndexOp};
use mlx_rs::ops::{argpartition_axis, gather_mm, gather_qmm, softmax_axis};
use mlx_rs::{Array, Dtype};

use super::activation::gated_gelu;
use super::config::MoeConfig;
use super::linear::{Linear, Loader};

struct Router {
    proj: Linear,
    /// Per-channel scale applied after a weightless RMS norm, folded with `hidden^-0.5`.
    scale: Array,
    per_expert_scale: Array,
}

pub struct Experts {
    cfg: MoeConfig,
    eps: f32,
    router: Router,
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Experts {
    /// Bytes of the expert weights one token does not read: all but its `top_k` experts.
    pub fn unread_nbytes_per_token(&self) -> usize {
        let all = self.gate.nbytes() + self.up.nbytes() + self.down.nbytes();
        all / self.cfg.num_experts * (self.cfg.num_experts - self.cfg.top_k)
    }
}

/// `x @ W[e].T` for each token and each of its chosen experts.
/// `x`: `[T, 1, 1, in]`, `experts`: `[T, k]` → `[T, k, 1, out]`.
fn expert_matmul(w: &Linear, x: &Array, experts: &Array) -> Result<Array> {
    Ok(match w {
        Linear::Dense(d) => gather_mm(x, &d.transposed, None, experts, None)?,
        Linear::Quantized(q) => gather_qmm(
            x,
            &q.packed,
            &q.scales,
            &q.biases,
            None,
            experts,
            true,
            q.spec.group_size,
            q.spec.bits,
            None,
        )?,
    })
}

impl Experts {
    pub fn load(w: &Loader, layer: usize, cfg: MoeConfig, hidden: usize, eps: f32) -> Result<Self> {
        let p = format!("layers.{layer}.");
        let (e, i) = (cfg.num_experts, cfg.expert_intermediate_size);
        let router = Router {
            proj: w.linear(&format!("{p}router.proj"), e, hidden)?,
            scale: w
                .tensor_f32(&format!("{p}router.scale"), &[hidden])?
                .multiply(Array::from_f32((hidden as f32).powf(-0.5)))?
                .as_dtype(w.dtype)?,
            per_expert_scale: w.tensor_f32(&format!("{p}router.per_expert_scale"), &[e])?,
        };
        let (gate, up, down) = if w.has(&format!("{p}experts.gate_up_proj")) {
            let fused = w.tensor(&format!("{p}experts.gate_up_proj"), &[e, 2 * i, hidden])?;
            let i = i as i32;
            (
                Linear::dense(fused.index((.., ..i, ..)))?,
                Linear::dense(fused.index((.., i.., ..)))?,
                w.matrix(
                    &format!("{p}experts.down_proj"),
                    &format!("{p}experts.down_proj"),
                    &[e],
                    hidden,
                    i as usize,
                )?,
            )
        } else {
            let s = format!("{p}experts.switch_glu.");
            let m = |name: &str, out: usize, inp: usize| {
                let module = format!("{s}{name}");
                w.matrix(&module, &format!("{module}.weight"), &[e], out, inp)
            };
            (
                m("gate_proj", i, hidden)?,
                m("up_proj", i, hidden)?,
                m("down_proj", hidden, i)?,
            )
        };
        Ok(Experts {
            cfg,
            eps,
            router,
            gate,
            up,
            down,
        })
    }

    /// `residual` (`[T, H]`) drives routing; `x` is the pre-normed expert input.
    pub fn forward(&self, residual: &Array, x: &Array) -> Result<Array> {
        let (t, h) = (x.shape()[0], x.shape()[1]);
        let k = self.cfg.top_k as i32;

        let r = rms_norm(residual, None, self.eps)?.multiply(&self.router.scale)?;
        let scores = self
            .router
            .proj
            .forward(&r)?
            .reshape(&[t, -1])?
            .as_dtype(Dtype::Float32)?;
        // Indices of the k largest scores (order within the k does not matter).
        let experts = argpartition_axis(&scores.negative()?, k - 1, -1)?.index((.., ..k));
        let weights = softmax_axis(&take_along_axis(&scores, &experts, -1)?, -1, true)?
            .multiply(&self.router.per_expert_scale.take_axis(&experts, 0)?)?;

        let xe = x.reshape(&[t, 1, 1, h])?;
        let gate = expert_matmul(&self.gate, &xe, &experts)?;
        let up = expert_matmul(&self.up, &xe, &experts)?;
        let y = expert_matmul(&self.down, &gated_gelu(&gate, &up)?, &experts)?; // [T, k, 1, H]
        let y = y.reshape(&[t, k, h])?;
        let weights = weights.as_dtype(y.dtype())?.reshape(&[t, k, 1])?;
        Ok(y.multiply(&weights)?.sum_axis(1, false)?.reshape(&[t, h])?)
    }
}
