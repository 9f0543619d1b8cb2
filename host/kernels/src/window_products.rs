//! The feed-forward and closing products of [`super::products`] for a window of 2 to 8 tokens
//! over dense weights, for layers too wide for the one post-attention kernel
//! ([`super::window_post_attention`]): the 31B's 21 504-wide feed-forward, whose decode steps
//! run the three products.
//!
//! Why: a verify window must give each token what a decode step gives it, bit for bit, or
//! greedy speculation can differ from plain decoding at a near tie; MLX's operations over a
//! window take other summation orders than our single-token kernels, so without these the
//! 31B's windows verified a token at a time and it could not speculate on a GPU.
//!
//! Each kernel stages every token's input in dynamic shared memory (`TOKENS × K` values, so
//! the widest input, 21 504 bf16 values, takes windows of up to 5 tokens), reads each weight
//! row once for all of them, and sums each (row, token) dot over the same pieces in the same
//! order as the single-token kernel (`rows_dot_window`); the norms, the GELU and the residual
//! round as there.

use std::cell::RefCell;

use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};

use super::products::{
    blocks_for_rows_per_warp, element_bytes, HEADER as PRODUCTS_HEADER, THREADS,
};
use super::window_post_attention::ROWS_DOT_WINDOW;
use super::{PerSharedMemory, TemplateArg};

const GATED_SOURCE: &str = include_str!("cuda/window_products_gated.cu");

const RESIDUAL_SOURCE: &str = include_str!("cuda/window_products_residual.cu");

/// Tokens a call takes at most (and at least 2: one token is [`super::products`]').
pub const MAX_TOKENS: usize = 8;

/// Dynamic shared memory a block may use, alone on a multiprocessor (an H200 has 228 KB a
/// multiprocessor, 1 KB of it reserved per block, and these kernels keep a little statically).
const MAX_SHARED_BYTES: usize = 216 * 1024;

fn header() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| format!("{PRODUCTS_HEADER}{ROWS_DOT_WINDOW}"))
}

thread_local! {
    static GATED: RefCell<PerSharedMemory> = RefCell::new(PerSharedMemory::new(
        "window_gated_product",
        &["x", "nw", "wg", "wu"],
        &["y"],
        GATED_SOURCE,
        header(),
    ));
    static RESIDUAL: RefCell<PerSharedMemory> = RefCell::new(PerSharedMemory::new(
        "window_product_residual",
        &["a", "w", "h", "pw", "scale", "counter"],
        &["out", "o"],
        RESIDUAL_SOURCE,
        header(),
    ));
}

/// Bytes of dynamic shared memory for `tokens` staged inputs of `k` values.
fn shared_bytes(k: usize, tokens: usize, element: usize) -> usize {
    tokens * k * element
}

/// Whether the kernels serve `tokens` tokens of `k` inputs a row in `dtype`: the single-token
/// products serve `k` ([`super::products::serves`]), 2 to [`MAX_TOKENS`] tokens, and the
/// staged inputs fit a block's shared memory.
pub fn serves(k: usize, tokens: usize, dtype: Dtype) -> bool {
    let Some(e) = element_bytes(dtype) else {
        return false;
    };
    (2..=MAX_TOKENS).contains(&tokens)
        && super::products::serves(k, dtype)
        && shared_bytes(k, tokens, e) <= MAX_SHARED_BYTES
}

/// The window `[T, K]` and a dense weight `[N, K]` of its dtype, or an error naming what.
fn check(kernel: &str, x: &Array, weights: &[(&Array, &str)]) -> Result<(i32, i32, i32)> {
    let (tokens, k) = match x.shape() {
        [t, k] => (*t, *k),
        other => bail!("{kernel}: the input is {other:?}, expected [tokens, K]"),
    };
    if !serves(k as usize, tokens as usize, x.dtype()) {
        bail!(
            "{kernel} does not serve {tokens} tokens of {k} inputs in {:?}",
            x.dtype()
        );
    }
    let mut rows = None;
    for (w, what) in weights {
        match w.shape() {
            [n, kk] if *kk == k && w.dtype() == x.dtype() && rows.is_none_or(|r| r == *n) => {
                rows = Some(*n)
            }
            other => bail!(
                "{kernel}: {what} is {other:?} {:?}, expected [rows, {k}] {:?}",
                w.dtype(),
                x.dtype()
            ),
        }
    }
    Ok((tokens, k, rows.unwrap_or(0)))
}

/// `gelu_tanh(W_g · x'_t) * (W_u · x'_t)` for every token `t` of `x` (`[T, K]`), `x'` =
/// `rms_norm(x, norm)` or `x`; `gate` and `up` dense `[N, K]`. Returns `[T, N]`, each row
/// [`super::products::gated_product`]'s for that token. Check [`serves`].
pub fn window_gated_product(
    x: &Array,
    norm: Option<&Array>,
    eps: f32,
    gate: &Array,
    up: &Array,
) -> Result<Array> {
    let kernel = "window_gated_product";
    let (tokens, k, n) = check(
        kernel,
        x,
        &[(gate, "the gate weight"), (up, "the up weight")],
    )?;
    let dtype = x.dtype();
    let shared = shared_bytes(
        k as usize,
        tokens as usize,
        element_bytes(dtype).unwrap_or(2),
    );
    GATED.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let mut out = kernels.get(shared, eps)?.apply(
            &[x, norm.unwrap_or(x), gate, up],
            &[(&[tokens, n], dtype)],
            (blocks_for_rows_per_warp(n, 1) * THREADS, 1, 1),
            (THREADS, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(dtype)),
                (c"K", TemplateArg::Int(k)),
                (c"N", TemplateArg::Int(n)),
                (c"NORM", TemplateArg::Bool(norm.is_some())),
                (c"TOKENS", TemplateArg::Int(tokens)),
            ],
        )?;
        Ok(out.remove(0))
    })
}

/// `h_t + rms_norm(W · a_t, post_norm)` (times `scale`, a one-element array, when given) for
/// every token `t` of `a` (`[T, K]`), `W` dense `[N, K]`, `h` `[T, N]`. Returns `[T, N]`, each
/// row [`super::products::product_residual`]'s for that token. `counter` is the call site's
/// ([`super::products::new_counter`]). Check [`serves`].
pub fn window_product_residual(
    a: &Array,
    w: &Array,
    h: &Array,
    post_norm: &Array,
    eps: f32,
    scale: Option<&Array>,
    counter: &Array,
) -> Result<Array> {
    let kernel = "window_product_residual";
    let (tokens, k, n) = check(kernel, a, &[(w, "the weight")])?;
    let dtype = a.dtype();
    if h.shape() != [tokens, n] || h.dtype() != dtype {
        bail!(
            "{kernel}: the residual is {:?} {:?}, expected [{tokens}, {n}] {dtype:?}",
            h.shape(),
            h.dtype()
        );
    }
    let shared = shared_bytes(
        k as usize,
        tokens as usize,
        element_bytes(dtype).unwrap_or(2),
    );
    RESIDUAL.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let mut out = kernels.get(shared, eps)?.apply(
            &[a, w, h, post_norm, scale.unwrap_or(post_norm), counter],
            &[(&[tokens, n], dtype), (&[tokens * n], Dtype::Float32)],
            (blocks_for_rows_per_warp(n, 1) * THREADS, 1, 1),
            (THREADS, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(dtype)),
                (c"K", TemplateArg::Int(k)),
                (c"N", TemplateArg::Int(n)),
                (c"SCALED", TemplateArg::Bool(scale.is_some())),
                (c"TOKENS", TemplateArg::Int(tokens)),
            ],
        )?;
        Ok(out.remove(0))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_windows_whose_staged_inputs_fit_one_block() {
        // The 31B's feed-forward input: 42 KB a token in bf16, so up to 5 tokens.
        assert!(serves(21504, 5, Dtype::Bfloat16));
        assert!(!serves(21504, 6, Dtype::Bfloat16));
        assert!(serves(5376, 8, Dtype::Bfloat16));
        assert!(
            !serves(5376, 1, Dtype::Bfloat16),
            "one token is the step's kernel"
        );
        assert!(!serves(5376, 9, Dtype::Bfloat16));
        assert!(
            !serves(21504, 2, Dtype::Float32),
            "84 KB a token is past the step's kernel"
        );
        assert!(!serves(256, 2, Dtype::Int32));
    }

    #[test]
    fn wrong_shapes_are_refused_before_any_kernel() {
        let x = Array::zeros::<f32>(&[2, 64]).unwrap();
        let w = Array::zeros::<f32>(&[16, 32]).unwrap();
        let err = window_gated_product(&x, None, 1e-6, &w, &w).unwrap_err();
        assert!(err.to_string().contains("the gate weight"), "{err}");
        let one = Array::zeros::<f32>(&[1, 64]).unwrap();
        let w = Array::zeros::<f32>(&[16, 64]).unwrap();
        let err = window_gated_product(&one, None, 1e-6, &w, &w).unwrap_err();
        assert!(err.to_string().contains("does not serve 1 tokens"), "{err}");
        let h = Array::zeros::<f32>(&[2, 8]).unwrap();
        let counter = Array::zeros::<u32>(&[16]).unwrap();
        let err = window_product_residual(&x, &w, &h, &w, 1e-6, None, &counter).unwrap_err();
        assert!(err.to_string().contains("the residual"), "{err}");
    }
}
