//! How a forward whose result is read at once (a verify window) reaches the device: whole at
//! the end, or a group of layers at a time as the host builds them.
//!
//! MLX evaluates lazily: until the host asks for a result, the device has nothing to do. In
//! pipelined decoding that costs nothing, since the host builds step n + 1 while the device runs
//! step n. A verify round cannot be pipelined that way (the host reads the target's picks
//! before it can draft again), so the device idles while the host builds the window's graph
//! and MLX encodes it, about 3 ms of a dense E4B round on an H200. Handing the hidden state to
//! the device (`async_eval`) after every few layers lets the device start on the first layers
//! while the host builds the rest. The values are the same either way: only when the work is
//! submitted changes.

/// Layers a group on a GPU unless the load options say otherwise
/// ([`super::RunSettings::handoff_layers`]): a dense E4B window (42 layers) goes out in 14
/// groups, each one more commit of a CUDA graph for MLX. Groups of 3 were ahead of groups of 6
/// in 18 of 20 replayed cases on an H200 (by 1-10 %; BENCHMARKS.md).
pub const DEFAULT_GPU_HANDOFF_LAYERS: usize = 3;

/// Whether the output of layer `index` (0-based, of `num_layers`) ends a group of `group`
/// layers and goes to the device before the next layer is built. The last layer never does:
/// the caller evaluates the forward's result itself.
pub fn hands_off_after(index: usize, num_layers: usize, group: usize) -> bool {
    group > 0 && (index + 1) % group == 0 && index + 1 < num_layers
}

#[cfg(test)]
mod tests {
    use super::hands_off_after;

    #[test]
    fn groups_end_every_few_layers_but_never_at_the_last() {
        let ends: Vec<usize> = (0..42).filter(|&i| hands_off_after(i, 42, 6)).collect();
        assert_eq!(ends, vec![5, 11, 17, 23, 29, 35]);
        // 42 is a multiple of 6 and 7: the last layer's output is the caller's to evaluate.
        assert!(!hands_off_after(41, 42, 7));
        assert!(hands_off_after(40, 42, 1));
        assert!((0..42).all(|i| !hands_off_after(i, 42, 0)));
        assert!((0..4).all(|i| !hands_off_after(i, 4, 8)));
    }
}
