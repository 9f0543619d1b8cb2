//! The row's own key/value cache: one attention layer's rows, in position order, trimmable.
//!
//! Row `i` of the cache holds the keys (after `k_norm` and RoPE) and values of the row built
//! at position `first_position + i`. The target's caches are never touched.

use mlx_spec_plugin_api::mlx_rs::ops::concatenate;
use mlx_spec_plugin_api::mlx_rs::ops::indexing::IndexOp;
use mlx_spec_plugin_api::mlx_rs::Array;

use crate::linear::mlx_err;

#[derive(Default)]
pub struct RowCache {
    /// `[1, kv_heads, rows, head_dim]` each, or `None` while empty.
    kv: Option<(Array, Array)>,
    first_position: u64,
    rows: usize,
}

impl RowCache {
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The position the next appended row takes.
    pub fn next_position(&self) -> u64 {
        self.first_position + self.rows as u64
    }

    /// Starts an empty cache whose first row will be at `position`.
    pub fn start_at(&mut self, position: u64) {
        *self = RowCache {
            kv: None,
            first_position: position,
            rows: 0,
        };
    }

    pub fn first_position(&self) -> u64 {
        self.first_position
    }

    /// Appends `rows` rows and returns the whole cache's keys and values.
    pub fn append(&mut self, keys: Array, values: Array) -> Result<(Array, Array), String> {
        let added = keys.shape()[2] as usize;
        let e = mlx_err("appending to the MTP cache");
        let kv = match self.kv.take() {
            None => (keys, values),
            Some((k, v)) => (
                concatenate(&[k, keys], 2).map_err(&e)?,
                concatenate(&[v, values], 2).map_err(&e)?,
            ),
        };
        self.rows += added;
        self.kv = Some(kv.clone());
        Ok(kv)
    }

    /// Keeps the first `rows` rows.
    pub fn truncate(&mut self, rows: usize) {
        if rows >= self.rows {
            return;
        }
        self.kv = match (rows, self.kv.take()) {
            (0, _) | (_, None) => None,
            (n, Some((k, v))) => {
                let n = n as i32;
                Some((k.index((.., .., ..n, ..)), v.index((.., .., ..n, ..))))
            }
        };
        self.rows = rows;
    }

    /// The cached keys and values (tests compare them with the oracle's).
    pub fn keys_values(&self) -> Option<&(Array, Array)> {
        self.kv.as_ref()
    }

    pub fn nbytes(&self) -> usize {
        self.kv.as_ref().map_or(0, |(k, v)| k.nbytes() + v.nbytes())
    }
}
