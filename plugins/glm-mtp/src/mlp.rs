//! The row's MLP: one SwiGLU, or GLM's routed experts.
//!
//! Routing (GLM-4.5 / DeepSeek-V3): `s = sigmoid(x · Wgateᵀ)` in float32; experts are chosen on
//! `s + e_score_correction_bias` (within the `topk_group` best groups when `n_group > 1`, a
//! group scored by the sum of its two best), weighted by `s` WITHOUT the bias, normalised to
//! sum 1 when `norm_topk_prob`, times `routed_scaling_factor`; the shared expert is added
//! unweighted. A draft forward is a handful of rows, so the choice is made on the host and
//! each chosen expert runs once over the rows that chose it.

use mlx_spec_plugin_api::mlx_rs::ops::{matmul, sigmoid};
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

use crate::config::{ExpertsConfig, MlpConfig, MtpConfig};
use crate::linear::{mlx_err, Linear, Loader};

/// `down(silu(gate(x)) * up(x))`.
pub struct SwiGlu {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl SwiGlu {
    fn load(
        loader: &Loader<'_>,
        module: &str,
        hidden: usize,
        width: usize,
    ) -> Result<Self, String> {
        Ok(SwiGlu {
            gate: loader.linear(&format!("{module}.gate_proj"), width, hidden, false)?,
            up: loader.linear(&format!("{module}.up_proj"), width, hidden, false)?,
            down: loader.linear(&format!("{module}.down_proj"), hidden, width, false)?,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array, String> {
        let e = mlx_err("MTP MLP");
        let g = self.gate.forward(x)?;
        let act = g.multiply(sigmoid(&g).map_err(&e)?).map_err(&e)?;
        let h = act.multiply(self.up.forward(x)?).map_err(&e)?;
        self.down.forward(&h)
    }

    fn nbytes(&self) -> usize {
        self.gate.nbytes() + self.up.nbytes() + self.down.nbytes()
    }
}

pub struct Experts {
    config: ExpertsConfig,
    /// `[E, H]` in float32: routing is computed in float32 whatever the compute dtype.
    router: Array,
    correction_bias: Vec<f32>,
    experts: Vec<SwiGlu>,
    shared: Option<SwiGlu>,
}

pub enum Mlp {
    Dense(SwiGlu),
    Experts(Experts),
}

impl Mlp {
    pub fn load(config: &MtpConfig, loader: &Loader<'_>) -> Result<Self, String> {
        let h = config.hidden_size;
        match &config.mlp {
            MlpConfig::Dense { intermediate } => {
                if loader.has("mlp.gate.weight") {
                    return Err(format!(
                        "{}mlp.gate.weight exists, but config.json makes row {} dense (first_k_dense_replace)",
                        loader.prefix, config.layer_index
                    ));
                }
                Ok(Mlp::Dense(SwiGlu::load(loader, "mlp", h, *intermediate)?))
            }
            MlpConfig::Experts(c) => {
                let e = c.num_experts;
                let router = loader
                    .float("mlp.gate.weight", &[e, h])?
                    .as_dtype(Dtype::Float32)
                    .map_err(mlx_err("casting the router"))?;
                let bias_name = format!("{}mlp.gate.e_score_correction_bias", loader.prefix);
                let correction_bias = if loader.has("mlp.gate.e_score_correction_bias") {
                    let b = loader
                        .checkpoint
                        .tensor(&bias_name, &[e])?
                        .as_dtype(Dtype::Float32)
                        .map_err(mlx_err("reading the router's correction bias"))?;
                    b.as_slice::<f32>().to_vec()
                } else {
                    vec![0.0; e]
                };
                let experts = (0..e)
                    .map(|i| SwiGlu::load(loader, &format!("mlp.experts.{i}"), h, c.intermediate))
                    .collect::<Result<Vec<_>, _>>()?;
                let shared = if c.shared_intermediate > 0 {
                    Some(SwiGlu::load(
                        loader,
                        "mlp.shared_experts",
                        h,
                        c.shared_intermediate,
                    )?)
                } else {
                    None
                };
                Ok(Mlp::Experts(Experts {
                    config: c.clone(),
                    router,
                    correction_bias,
                    experts,
                    shared,
                }))
            }
        }
    }

    /// `x` `[rows, H]` (already normed) to `[rows, H]`.
    pub fn forward(&self, x: &Array) -> Result<Array, String> {
        match self {
            Mlp::Dense(m) => m.forward(x),
            Mlp::Experts(m) => m.forward(x),
        }
    }

    pub fn nbytes(&self) -> usize {
        match self {
            Mlp::Dense(m) => m.nbytes(),
            Mlp::Experts(m) => {
                m.router.nbytes()
                    + m.experts.iter().map(SwiGlu::nbytes).sum::<usize>()
                    + m.shared.as_ref().map_or(0, SwiGlu::nbytes)
            }
        }
    }
}

impl Experts {
    /// The chosen experts and their weights for one row's sigmoid scores.
    pub fn route(&self, scores: &[f32]) -> Vec<(usize, f32)> {
        let c = &self.config;
        let choice: Vec<f32> = scores
            .iter()
            .zip(&self.correction_bias)
            .map(|(s, b)| s + b)
            .collect();
        let per_group = c.num_experts / c.n_group;
        let mut allowed = vec![true; c.num_experts];
        if c.n_group > 1 {
            let mut groups: Vec<(usize, f32)> = (0..c.n_group)
                .map(|g| {
                    let mut members = choice[g * per_group..(g + 1) * per_group].to_vec();
                    members.sort_by(|a, b| b.total_cmp(a));
                    (g, members.iter().take(2).sum())
                })
                .collect();
            groups.sort_by(|a, b| b.1.total_cmp(&a.1));
            allowed = vec![false; c.num_experts];
            for &(g, _) in groups.iter().take(c.topk_group) {
                allowed[g * per_group..(g + 1) * per_group].fill(true);
            }
        }
        let mut order: Vec<usize> = (0..c.num_experts).filter(|&i| allowed[i]).collect();
        order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]));
        order.truncate(c.top_k);
        let mut picked: Vec<(usize, f32)> = order.into_iter().map(|i| (i, scores[i])).collect();
        if c.norm_topk_prob {
            let total: f32 = picked.iter().map(|p| p.1).sum::<f32>() + 1e-20;
            for p in &mut picked {
                p.1 /= total;
            }
        }
        for p in &mut picked {
            p.1 *= c.routed_scaling_factor;
        }
        picked
    }

    fn forward(&self, x: &Array) -> Result<Array, String> {
        let e = mlx_err("MTP experts");
        let rows = x.shape()[0] as usize;
        let n = self.config.num_experts;
        let scores = x
            .as_dtype(Dtype::Float32)
            .and_then(|x| matmul(&x, self.router.t()))
            .and_then(|l| sigmoid(&l))
            .map_err(&e)?;
        scores.eval().map_err(&e)?;
        let scores = scores.as_slice::<f32>();
        // For each expert, the rows that chose it and their weights.
        let mut chosen: Vec<Vec<(usize, f32)>> = vec![Vec::new(); n];
        for r in 0..rows {
            for (expert, weight) in self.route(&scores[r * n..(r + 1) * n]) {
                chosen[expert].push((r, weight));
            }
        }
        let mut out = match &self.shared {
            Some(shared) => shared.forward(x)?,
            None => x.multiply(Array::from_f32(0.0)).map_err(&e)?,
        };
        for (expert, picks) in chosen.iter().enumerate() {
            if picks.is_empty() {
                continue;
            }
            let index: Vec<i32> = picks.iter().map(|p| p.0 as i32).collect();
            let index = Array::from_slice(&index, &[picks.len() as i32]);
            let y = self.experts[expert].forward(&x.take_axis(&index, 0).map_err(&e)?)?;
            // scatter[r, j] = weight of pick j when it is row r's, so scatter @ y adds each
            // weighted expert output to its own row.
            let mut scatter = vec![0f32; rows * picks.len()];
            for (j, &(r, w)) in picks.iter().enumerate() {
                scatter[r * picks.len() + j] = w;
            }
            let scatter = Array::from_slice(&scatter, &[rows as i32, picks.len() as i32])
                .as_dtype(y.dtype())
                .map_err(&e)?;
            out = out.add(matmul(&scatter, &y).map_err(&e)?).map_err(&e)?;
        }
        Ok(out)
    }
}
