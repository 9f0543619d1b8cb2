//! Device helpers for 4-bit affine weights in MLX's layout (eight values a 32-bit word,
//! lowest bits first; a scale and a bias per group of G values, G a multiple of 32), shared by
//! the kernels that read such rows ([`super::post_attention`], [`super::attention_heads`],
//! the gated and closing products of [`super::products`]).
//!
//! A lane reads 16 bytes of a row at a time: 32 values of one group. It sums
//! `scale (q . x) + bias (sum of x)` over them in float32, where MLX's CUDA product
//! accumulates in the activation dtype: the kernels compute the checkpoint's function at
//! least as closely, and are checked against transformers (the 4-bit fixture), not against
//! MLX's bits. A 16-byte chunk holds four times the values of a bf16 chunk, so the arithmetic
//! is kept lean:
//! * the inputs come from shared memory in 16-byte pieces whose order is turned per lane
//!   pair ([`HEADER`]'s `piece_at`): no bank conflicts (2-byte reads 64 bytes apart had
//!   sixteen-way conflicts and made the first version run at 0.30 TB/s);
//! * a value becomes a float by being or-ed into the bits of 2^23 and 2^23 subtracted: no
//!   integer-to-float conversion, a quarter-rate instruction;
//! * the sums of the input over each chunk (the bias term) are made once a stage
//!   (`chunk_sums`), not once a row;
//! * a lane keeps up to eight 16-byte loads in flight across its rows and chunks.
//!
//! The text needs the products' header (`products::HEADER`: `warp_sum`, `BLOCK_THREADS`,
//! `rows_dot`) before it. `weight_dot` reads rows of either kind by index.

/// The device helpers (CUDA source text).
pub const HEADER: &str = include_str!("cuda/affine4.cuh");

/// Device helpers of the window kernels (after [`HEADER`] and the window row dots,
/// `rows_dot_window`): each token's chunk sums, and rows of either kind by index for a window
/// of tokens. 4-bit rows go through [`HEADER`]'s `rows_dot_affine4_tokens` and
/// `rows_dot_affine4_int_tokens`, which a decode step calls with one token: each (row, token)
/// sum is made of the same operations in the same order as that token's alone, so a verify
/// window scores each token as a decode step does, bit for bit.
pub const WINDOW_HEADER: &str = include_str!("cuda/affine4_window.cuh");
